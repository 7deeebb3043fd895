"""Static graph path behaviour: EOS, reuse, recapture per signature member, failure, refusals."""

from __future__ import annotations

import warnings

import pytest
import torch
from fakes import NoGraphBackend, SideStreamBackend
from rollout_models import PAD, distinct_tokens_per_row, make_engine, prompts, run, tiny_model

from graphcap.cpu import CPUBackend
from graphcap.rollout import (
    CaptureFallbackWarning,
    GraphUnsupportedModelError,
    RolloutConfig,
    SamplingParams,
    load_weights_in_place,
)

# A capture that falls back to eager would still produce equal tokens; make it loud instead.
pytestmark = pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")

NEW = 8
NO_EOS = {"eos_token_id": []}


def test_eos_on_third_token_stops_early_with_equal_output():
    model = tiny_model("llama")
    ids, mask = prompts(3)
    width = ids.shape[1]
    new = 20
    probe = run(model, ids, mask, False, max_new_tokens=new, **NO_EOS)
    eos = sorted({int(t) for t in probe.sequences[:, width + 2]})  # each row's third token
    # no ladder: it reads the flags every 4 steps, this test counts the interval's 16
    graph = run(model, ids, mask, True, ladder=None, max_new_tokens=new, eos_token_id=eos)
    eager = run(model, ids, mask, False, ladder=None, max_new_tokens=new, eos_token_id=eos)
    assert graph.stats.path == "static_graph"
    assert torch.equal(graph.sequences, eager.sequences)
    assert graph.response_lengths.tolist() == [3, 3, 3]
    assert graph.finish_reasons == ["eos"] * 3
    assert graph.response_mask.sum(-1).tolist() == [3, 3, 3]
    assert (graph.sequences[:, width + 3 :] == PAD).all()
    # the host saw "all finished" at the first check (step 16) instead of running 19 steps
    assert graph.stats.replays == 16 < new - 1
    short = make_engine(model, eos_check_interval=4).generate(
        ids, mask, SamplingParams(max_new_tokens=new, eos_token_id=eos)
    )
    assert short.stats.replays == 4 and short.stats.steps == 4
    assert torch.equal(short.sequences, graph.sequences)


def test_reuse_weights_width_and_recapture_on_total_length():
    model = tiny_model("llama", fresh=True)
    # the static cache and no length buckets: a block table rounds the total length up to
    # whole blocks, and the default buckets to powers of two, so there a longer call within
    # the last block or bucket replays the same graph
    engine = make_engine(model, kv_block_size=None, length_buckets=None)
    ids, mask = prompts(3, width=6)
    sampling = SamplingParams(max_new_tokens=NEW, **NO_EOS)
    first = engine.generate(ids, mask, sampling)
    assert first.stats.captured and first.stats.captures == 1
    assert distinct_tokens_per_row(first)
    again = engine.generate(ids, mask, sampling)
    assert not again.stats.captured and again.stats.captures == 1
    assert torch.equal(again.sequences, first.sequences)

    # in-place weight update: same graph, new tokens, equal to eager with the new weights
    new_weights = {
        name: p.detach() * 1.3 + 0.05 for name, p in model.named_parameters() if "mlp" in name
    }
    load_weights_in_place(model, new_weights, strict=False)
    updated = engine.generate(ids, mask, sampling)
    assert updated.stats.captures == 1 and updated.stats.path == "static_graph"
    assert not torch.equal(updated.sequences, first.sequences)
    assert torch.equal(updated.sequences, run(model, ids, mask, False, **_kw(sampling)).sequences)

    # a new prompt width with the same total length reuses the graph
    ids2, mask2 = prompts(3, width=9, seed=5)
    wider = SamplingParams(max_new_tokens=NEW - 3, **NO_EOS)
    reused = engine.generate(ids2, mask2, wider)
    assert reused.stats.captures == 1 and reused.stats.replays == NEW - 4
    assert torch.equal(reused.sequences, run(model, ids2, mask2, False, **_kw(wider)).sequences)

    # a new total length recaptures
    longer = SamplingParams(max_new_tokens=NEW + 2, **NO_EOS)
    recaptured = engine.generate(ids, mask, longer)
    assert recaptured.stats.captured and recaptured.stats.captures == 2
    assert recaptured.stats.recapture_reason == ["total_len"]
    assert torch.equal(recaptured.sequences, run(model, ids, mask, False, **_kw(longer)).sequences)

    cache = engine.cache
    assert cache is not None and cache.nbytes() > 0
    engine.shutdown()
    assert engine.cache is None and cache.nbytes() == 0


def _kw(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in params.__dataclass_fields__}


def _replace_param(model):
    head = model.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach() * -1.0)


def _set_eager_attention(model):
    model.set_attn_implementation("eager")


# name -> (signature member, sampling overrides, model mutation, context manager factory)
SIGNATURE_CHANGES = {
    "batch_size": ("batch_size", {}, None),
    "total_len": ("total_len", {"max_new_tokens": NEW + 1}, None),
    "dtype": ("dtype", {}, lambda m: m.to(torch.float64)),
    "training": ("training", {}, lambda m: m.train()),
    "attn_implementation": ("attn_implementation", {}, _set_eager_attention),
    "autocast": ("autocast", {}, None),
    # the sampler's shape grows once: the first sampled call and the first log-prob call
    "do_sample": ("sampler", {"do_sample": True}, None),
    "pad_id": ("pad_id", {"pad_token_id": 3}, None),
    "return_logprobs": ("sampler", {"return_logprobs": True}, None),
}


def test_a_parameter_in_new_storage_is_copied_into_what_the_graph_reads():
    """A new address is no recapture: the engine keeps the storage its graph read and copies
    the new values there for the call (docs/rollout.md, "Memory between rollouts")."""
    model = tiny_model("llama", fresh=True)
    engine = make_engine(model, length_buckets=None)
    ids, mask = prompts(3)
    params = SamplingParams(max_new_tokens=NEW, do_sample=True, top_k=0, seed=3, **NO_EOS)
    first = engine.generate(ids, mask, params)
    _replace_param(model)
    second = engine.generate(ids, mask, params)
    reference = run(model, ids, mask, False, **_kw(params))
    assert not second.stats.captured and second.stats.captures == first.stats.captures
    assert second.stats.weights == "adopted" and second.stats.weights_copied == 1
    assert torch.equal(second.sequences, reference.sequences)
    assert not torch.equal(second.sequences, first.sequences)


@pytest.mark.parametrize("change", sorted(SIGNATURE_CHANGES))
def test_each_signature_member_change_recaptures(change):
    member, overrides, mutate = SIGNATURE_CHANGES[change]
    model = tiny_model("llama", fresh=True)
    # the static cache: a block table rounds total_len up to whole blocks (one more column
    # within the last block keeps the graph)
    engine = make_engine(
        model, kv_block_size=None if change == "total_len" else "auto", length_buckets=None
    )
    ids, mask = prompts(3)
    base = {"max_new_tokens": NEW, "do_sample": True, "top_k": 0, "seed": 3, **NO_EOS}
    if change == "do_sample":
        base["do_sample"] = False
    first = engine.generate(ids, mask, SamplingParams(**base))
    assert first.stats.captures == 1
    changed = {**base, **overrides}
    if change == "batch_size":
        ids, mask = prompts(4)
    if mutate is not None:
        mutate(model)
    autocast = change == "autocast"
    context = (
        torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
        if autocast
        else torch.autocast("cpu", enabled=False)
    )
    with context:
        second = engine.generate(ids, mask, SamplingParams(**changed))
        reference = run(model, ids, mask, False, **changed)
    assert second.stats.captured and second.stats.captures == 2
    assert member in second.stats.recapture_reason
    assert second.stats.path == "static_graph"
    assert torch.equal(second.sequences, reference.sequences)


def test_new_eos_ids_replay_the_same_graph():
    """EOS and stop ids are a device table written per call, not a signature member."""
    model = tiny_model("llama")
    engine = make_engine(model, batch_ladder=None)  # one graph: no smaller sizes
    ids, mask = prompts(3)
    probe = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS))
    eos = int(probe.sequences[0, ids.shape[1] + 2])  # ends row 0 at its third token
    second = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, eos_token_id=[eos]))
    assert second.stats.captures == 1 and not second.stats.captured
    reference = run(model, ids, mask, False, max_new_tokens=NEW, eos_token_id=[eos])
    assert torch.equal(second.sequences, reference.sequences)
    assert second.finish_reasons[0] == "eos" and second.response_lengths[0] == 3


def test_same_settings_never_recapture():
    model = tiny_model("gpt2")
    engine = make_engine(model)
    ids, mask = prompts(3)
    params = SamplingParams(do_sample=True, top_k=10, max_new_tokens=NEW, seed=1)
    counts = [engine.generate(ids, mask, params).stats.captures for _ in range(3)]
    assert counts == [1, 1, 1]


def test_greedy_ignores_warper_settings_and_reuses_the_graph():
    model = tiny_model("llama")
    engine = make_engine(model)
    ids, mask = prompts(3)
    first = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS))
    warped = SamplingParams(
        max_new_tokens=NEW, do_sample=False, temperature=0.3, top_p=0.5, top_k=4, **NO_EOS
    )
    second = engine.generate(ids, mask, warped)
    assert second.stats.captures == 1 and second.stats.recapture_reason == []
    assert torch.equal(first.sequences, second.sequences)


def test_capture_failure_rolls_back_and_stays_eager_with_one_warning():
    model = tiny_model("llama", fresh=True)
    backend = CPUBackend()

    def host_read_during_capture(module, args, output):
        if backend.is_current_stream_capturing():
            output[0].sum().item()  # a host sync: the CPU graph refuses it mid-capture

    handle = model.model.layers[1].register_forward_hook(host_read_during_capture)
    engine = make_engine(model, backend=backend)
    ids, mask = prompts(3)
    params = SamplingParams(do_sample=True, top_k=10, max_new_tokens=NEW, seed=4, **NO_EOS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        failed = engine.generate(ids, mask, params)
        rng_after_failed = torch.get_rng_state()
        later = engine.generate(ids, mask, params)
    handle.remove()
    fallbacks = [w for w in caught if issubclass(w.category, CaptureFallbackWarning)]
    assert len(fallbacks) == 1
    pure = run(model, ids, mask, False, **_kw(params))
    assert torch.equal(torch.get_rng_state(), rng_after_failed)
    assert failed.stats.path == "eager" and not failed.stats.captured
    assert "capture failed" in failed.stats.fallback_reason
    # the capture failed after its warm-up: the outcome keeps the warm-up's seconds
    assert 0 < failed.stats.warmup_s <= failed.stats.capture_s
    assert torch.equal(failed.sequences, pure.sequences)
    assert later.stats.path == "eager" and later.stats.captures == 0
    assert "capture failed" in later.stats.fallback_reason
    assert torch.equal(later.sequences, pure.sequences)


def test_backend_without_graphs_runs_eagerly_with_reason():
    model = tiny_model("gpt2")
    ids, mask = prompts(2)
    result = run(model, ids, mask, True, backend=NoGraphBackend(), max_new_tokens=4)
    assert result.stats.path == "eager"
    assert "cannot capture" in result.stats.fallback_reason


def test_stateful_model_runs_eagerly_with_reason():
    model = tiny_model("llama", fresh=True)
    model._is_stateful = True  # private: transformers' own mark of recurrent-state models
    ids, mask = prompts(2)
    result = run(model, ids, mask, True, max_new_tokens=4)
    assert result.stats.path == "eager" and "stateful" in result.stats.fallback_reason


def test_non_resident_parameters_run_eagerly_with_reason():
    model = tiny_model("llama", fresh=True)
    model.register_parameter("placeholder", torch.nn.Parameter(torch.empty(0)))
    ids, mask = prompts(2)
    result = run(model, ids, mask, True, max_new_tokens=4)
    assert result.stats.path == "eager" and "zero-size" in result.stats.fallback_reason


def test_chunked_attention_layers_run_eagerly_with_reason():
    model = tiny_model("llama", fresh=True)
    model.config.layer_types = ["full_attention", "chunked_attention"]
    ids, mask = prompts(2)
    result = run(model, ids, mask, True, max_new_tokens=NEW, **NO_EOS)
    assert result.stats.path == "eager" and "chunked_attention" in result.stats.fallback_reason
    # Llama ignores layer_types, so the eager loop (transformers-built masks) must equal the
    # usual 4-D-mask result of the unmodified model
    plain = run(tiny_model("llama"), ids, mask, True, max_new_tokens=NEW, **NO_EOS)
    assert plain.stats.path == "static_graph"
    assert torch.equal(result.sequences, plain.sequences)


def test_autocast_weight_cache_runs_eagerly_with_reason():
    model = tiny_model("llama")
    ids, mask = prompts(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = run(model, ids, mask, True, max_new_tokens=4)
    assert result.stats.path == "eager" and "cache_enabled=False" in result.stats.fallback_reason


def test_graph_unsafe_attention_is_refused_by_name():
    model = tiny_model("llama", fresh=True)
    # private: set_attn_implementation refuses flash_attention_2 without flash-attn installed
    model.config._attn_implementation = "flash_attention_2"
    engine = make_engine(model)
    ids, mask = prompts(2)
    with pytest.raises(GraphUnsupportedModelError, match="flash_attention_2"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=4))


def test_single_new_token_needs_no_graph():
    model = tiny_model("gpt2")
    ids, mask = prompts(2)
    result = run(model, ids, mask, True, max_new_tokens=1)
    assert result.stats.captures == 0 and result.stats.replays == 0
    assert torch.equal(result.sequences, run(model, ids, mask, False, max_new_tokens=1).sequences)


def test_side_stream_warm_up_and_capture_match_eager():
    model = tiny_model("qwen2")
    ids, mask = prompts(3)
    params = {"do_sample": True, "top_p": 0.9, "max_new_tokens": NEW, "seed": 8, **NO_EOS}
    graph = run(model, ids, mask, True, backend=SideStreamBackend(), **params)
    assert graph.stats.path == "static_graph"
    assert torch.equal(graph.sequences, run(model, ids, mask, False, **params).sequences)


def test_recaptures_reuse_one_capture_stream():
    """A stream per capture would leak per-stream library workspaces (seen on the H200)."""

    class CountingBackend(SideStreamBackend):
        streams = 0

        def new_stream(self):
            CountingBackend.streams += 1
            return super().new_stream()

    model = tiny_model("llama")
    ids, mask = prompts(3)
    # the static cache: its total_len is in the signature, so each length recaptures
    engine = make_engine(model, backend=CountingBackend(), kv_block_size=None, length_buckets=None)
    captures = [
        engine.generate(ids, mask, SamplingParams(max_new_tokens=n, **NO_EOS)).stats.captures
        for n in (4, 5, 6)
    ]
    assert captures == [1, 2, 3]
    assert CountingBackend.streams == 1


def test_buckets_let_varying_requests_share_one_graph():
    model = tiny_model("llama")
    # no ladder: bucket padding rows end at once, and this test counts one graph per bucket
    buckets = {"batch_buckets": (4, 8), "length_buckets": (16, 32), "batch_ladder": None}
    engine = make_engine(model, **buckets)
    eager = make_engine(model, False, **buckets)
    requests = [(3, 6, NEW), (4, 7, NEW), (2, 5, NEW + 3)]  # (rows, width, max_new_tokens)
    for rows, width, new in requests:
        ids, mask = prompts(rows, width=width, seed=rows)
        params = SamplingParams(max_new_tokens=new, **NO_EOS)
        result = engine.generate(ids, mask, params)
        assert result.stats.captures == 1 and result.stats.path == "static_graph"
        assert (result.stats.batch_size, result.stats.total_len) == (4, 16)
        assert result.sequences.shape == (rows, width + new)
        assert result.response_lengths.tolist() == [new] * rows
        # greedy rows are independent of padding rows: equal to an unbucketed eager run
        assert torch.equal(result.sequences, run(model, ids, mask, False, **_kw(params)).sequences)
    # sampling: padding rows change the draw shape, but graph == eager with the same buckets
    ids, mask = prompts(3, seed=9)
    params = SamplingParams(do_sample=True, top_k=12, max_new_tokens=NEW, seed=2, **NO_EOS)
    sampled = engine.generate(ids, mask, params)
    assert torch.equal(sampled.sequences, eager.generate(ids, mask, params).sequences)
    # larger than every batch bucket: runs at its own size (a new signature)
    ids, mask = prompts(9, seed=1)
    big = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS))
    assert big.stats.batch_size == 9 and big.stats.captures == 3


def test_bucket_sizes_are_validated():
    with pytest.raises(ValueError, match="batch_buckets"):
        RolloutConfig(batch_buckets=(0, 4))
    assert RolloutConfig(length_buckets=[64, 32, 32]).length_buckets == (32, 64)


def test_inference_mode_and_generator_are_signature_members():
    model = tiny_model("gpt2")
    engine = make_engine(model)
    ids, mask = prompts(2)
    params = SamplingParams(do_sample=True, top_k=10, max_new_tokens=NEW, seed=6, **NO_EOS)
    with torch.inference_mode():
        inside = engine.generate(ids, mask, params)
    outside = engine.generate(ids, mask, params)
    assert outside.stats.recapture_reason == ["inference_mode"]
    assert torch.equal(inside.sequences, outside.sequences)
    first_gen, second_gen = torch.Generator(), torch.Generator()
    a = engine.generate(ids, mask, params, generator=first_gen)
    global_rng = torch.get_rng_state()
    b = engine.generate(ids, mask, params, generator=second_gen)
    assert b.stats.recapture_reason == ["generator_id"] and b.stats.captures == 4
    assert torch.equal(a.sequences, b.sequences)  # both drew from params.seed's hash streams
    # seeded rows touch no generator: neither the default one nor the ones passed
    assert torch.equal(torch.get_rng_state(), global_rng)
    assert torch.equal(first_gen.get_state(), torch.Generator().get_state())
    assert torch.equal(second_gen.get_state(), torch.Generator().get_state())


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_nan_logits_in_one_row_reach_no_sampler_and_leave_other_rows_alone(graph):
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(3)
    params = {"do_sample": True, "top_k": 0, "max_new_tokens": NEW, "seed": 12, **NO_EOS}
    clean = run(model, ids, mask, graph, **params)

    def poison_row_zero(module, args, output):
        output = output.clone()
        output[0] = float("nan")  # on a GPU, NaN reaching multinomial is a device-side assert
        return output

    model.lm_head.register_forward_hook(poison_row_zero)
    poisoned = run(model, ids, mask, graph, **params)
    assert poisoned.stats.path == ("static_graph" if graph else "eager")
    assert torch.equal(poisoned.sequences[1:], clean.sequences[1:])
