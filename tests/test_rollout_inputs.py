"""Bad input and generate() parity (issues 14 and 16): every refusal names the field and comes
before device work; inputs generate() accepts give generate()'s tokens."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from rollout_models import EOS, VOCAB, ScriptedMemory, generate_padded, prompts, run, tiny_model

from graphcap.cpu import CPUBackend
from graphcap.rollout import (
    RequestTooLargeError,
    RolloutConfig,
    RolloutEngine,
    SamplingParams,
    load_weights_in_place,
)
from graphcap.rollout.plan.inputs import request_bytes, vocab_size
from graphcap.rollout.plan.scan import scan_model
from graphcap.rollout.sampling import sanitise


def _engine(model, **config) -> RolloutEngine:
    """An eager engine unless ``config`` asks for graphs."""
    config = {"enable_graph_capture": False, **config}
    return RolloutEngine(model, RolloutConfig(backend=CPUBackend(), **config))


# ---- issue 14 case 7: position tables ---------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_learned_position_table_is_refused_before_device_work(family):
    model = tiny_model(family)  # 64 positions
    ids, mask = prompts(2, width=6)
    engine = _engine(model)
    with pytest.raises(ValueError, match=r"learned table of 64.*lower max_new_tokens to 59"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=60))
    assert engine.cache is None  # nothing was allocated
    with pytest.raises(ValueError, match="prompt alone is too long"):
        engine.generate(*prompts(1, width=70), SamplingParams(max_new_tokens=2))


def test_learned_position_table_boundary_matches_generate():
    model = tiny_model("gpt2")
    ids, mask = prompts(2, width=50)  # 50 + 15 - 1 = all 64 positions
    got = run(model, ids, mask, graph=False, max_new_tokens=15, eos_token_id=[])
    want = generate_padded(model, ids, mask, 65, max_new_tokens=15, eos_token_id=None)
    assert torch.equal(got.sequences, want)


def test_rotary_model_past_its_limit_warns_once():
    model = tiny_model("llama", max_position_embeddings=9)
    ids, mask = prompts(1, width=6)
    engine = _engine(model)
    with pytest.warns(UserWarning, match="max_position_embeddings"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate(ids, mask, SamplingParams(max_new_tokens=5))


# ---- issue 14 case 8: token ids outside the vocabulary ----------------------------------------
@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_input_ids_outside_the_vocabulary_are_refused(bad):
    ids, mask = prompts(2)
    ids[1, -1] = bad
    with pytest.raises(ValueError, match=rf"input_ids holds token id {bad}.*\[0, {VOCAB}\)"):
        _engine(tiny_model("llama"), enable_graph_capture=True).generate(ids, mask)


# ---- issue 14 case 9: overflowing scores -------------------------------------------------------
@pytest.mark.parametrize(
    "settings",
    [{"temperature": 1e-38}, {"repetition_penalty": 1e-30}, {"repetition_penalty": 1e-38}],
)
def test_overflowing_settings_sample_on_the_graph_path(settings):
    model = tiny_model("llama")
    ids, mask = prompts(3)
    result = run(model, ids, mask, graph=True, do_sample=True, max_new_tokens=6, **settings)
    assert result.stats.path == "static_graph"
    assert int(result.sequences.min()) >= 0 and int(result.sequences.max()) < VOCAB


def test_sanitise_draws_among_the_infinite_scores_only():
    scores = torch.tensor(
        [[1.0, float("inf"), 2.0, float("inf")], [1.0, 2.0, 3.0, 4.0], [float("nan")] * 4]
    )
    half = torch.tensor([[6e4, 7e4, -1.0, 0.0]], dtype=torch.float16).float()  # fp16 overflow
    clean = sanitise(torch.cat([scores, half]), torch.zeros(4, dtype=torch.bool))
    probs = torch.softmax(clean, -1)
    assert torch.isfinite(probs).all()
    assert probs[0].tolist() == [0.0, 0.5, 0.0, 0.5]
    assert torch.equal(clean[1], scores[1])
    assert probs[3].tolist() == [0.0, 1.0, 0.0, 0.0]
    draws = torch.multinomial(probs, 64, replacement=True)
    assert set(draws[0].tolist()) <= {1, 3}


# ---- issue 14 case 11 / issue 16 case 5: weights ----------------------------------------------
def test_rotary_state_dict_loads_by_default_and_partial_loads_report_the_rest():
    model, other = tiny_model("llama", fresh=True), tiny_model("llama", fresh=True)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1)
    loaded = load_weights_in_place(model, other.state_dict())
    assert not loaded.not_updated and "lm_head.weight" in loaded.updated
    assert torch.equal(model.lm_head.weight, other.lm_head.weight)
    partial = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}
    assert load_weights_in_place(model, partial, strict=False).not_updated == ("lm_head.weight",)
    with pytest.raises(KeyError, match=r"lm_head\.weight"):
        load_weights_in_place(model, partial)


def test_tied_alias_counts_as_updated():
    model = tiny_model("gpt2", fresh=True)  # lm_head.weight is transformer.wte.weight
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert not load_weights_in_place(model, state).not_updated


# ---- issue 14 case 12 / issue 16 cases 4, 7, 8: typed settings --------------------------------
@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (SamplingParams, {"do_sample": "no"}, "do_sample"),
        (SamplingParams, {"temperature": "0.7"}, "temperature"),
        (SamplingParams, {"max_new_tokens": 8.5}, "max_new_tokens"),
        (SamplingParams, {"max_new_tokens": "5"}, "max_new_tokens"),
        (SamplingParams, {"max_new_tokens": 5.5}, "max_new_tokens"),
        (SamplingParams, {"top_k": 2.5}, "top_k"),
        (SamplingParams, {"eos_token_id": "12"}, "eos_token_id"),
        (RolloutConfig, {"enable_graph_capture": "no"}, "enable_graph_capture"),
        (RolloutConfig, {"length_buckets": "16"}, "length_buckets"),
        (RolloutConfig, {"batch_buckets": (2.5,)}, "batch_buckets"),
    ],
)
def test_wrongly_typed_settings_are_refused_with_the_field_name(cls, kwargs, field):
    with pytest.raises(TypeError, match=rf"{cls.__name__}\.{field} must be"):
        cls(**kwargs)


@pytest.mark.parametrize("eos", [np.int64(EOS), torch.tensor(EOS), [np.int32(EOS)]])
def test_eos_as_generate_accepts_it(eos):
    model = tiny_model("llama")
    ids, mask = prompts(3)
    got = run(model, ids, mask, graph=False, max_new_tokens=8, eos_token_id=eos)
    want = generate_padded(model, ids, mask, ids.shape[1] + 8, max_new_tokens=8)
    assert torch.equal(got.sequences, want)


def test_greedy_with_temperature_zero_matches_generate():
    model = tiny_model("qwen2")
    ids, mask = prompts(2)
    got = run(model, ids, mask, graph=True, max_new_tokens=6, temperature=0)
    want = generate_padded(
        model, ids, mask, ids.shape[1] + 6, max_new_tokens=6, do_sample=False, temperature=0.0
    )
    assert torch.equal(got.sequences, want)


def test_request_that_cannot_fit_is_refused_with_its_size():
    model = tiny_model("llama")
    ids, mask = prompts(3)
    with (
        pytest.warns(UserWarning, match="max_position_embeddings"),  # said first, as generate
        pytest.raises(ValueError, match=r"would allocate at least [0-9.]+ GiB.*available on cpu"),
    ):
        _engine(model).generate(ids, mask, SamplingParams(max_new_tokens=10**9))
    block = CPUBackend().capabilities.kv_block_size  # kv_block_size "auto": the backend's
    need = request_bytes(model, scan_model(model).dtype, 3, 16, 3, 6, block_size=block)
    engine = _engine(model, max_request_bytes=need - 1)
    with pytest.raises(ValueError, match=r"RolloutConfig\.max_request_bytes"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=10))
    assert engine.cache is None
    _engine(model, max_request_bytes=need).generate(ids, mask, SamplingParams(max_new_tokens=10))


def test_the_records_a_call_asks_for_count_in_the_request_limit():
    """``output_scores`` / ``output_logits`` each keep ``batch x total x vocab`` float32: 24
    times the limit at a vocabulary of 4,096, uncounted, ran out of memory instead of raising
    RequestTooLargeError. Each record asked for counts, and only those."""
    model = tiny_model("llama")
    ids, mask = prompts(3)
    block = CPUBackend().capabilities.kv_block_size
    dtype = scan_model(model).dtype
    plain, scores, both = (
        request_bytes(model, dtype, 3, 16, 3, 6, block_size=block, records=n) for n in (0, 1, 2)
    )
    assert scores - plain == both - scores == 3 * 16 * vocab_size(model) * 4
    sampling = SamplingParams(max_new_tokens=10)
    engine = _engine(model, max_request_bytes=scores - 1, length_buckets=None)
    assert engine.generate(ids, mask, sampling).scores is None  # fits without records
    for asked in ({"output_scores": True}, {"output_logits": True}):
        name = next(iter(asked))
        with pytest.raises(RequestTooLargeError, match=f"{name} recording.*leave {name} off"):
            engine.generate(ids, mask, sampling, **asked)
    engine = _engine(model, max_request_bytes=scores, length_buckets=None)
    assert engine.generate(ids, mask, sampling, output_logits=True).logits is not None
    with pytest.raises(RequestTooLargeError, match="output_scores and output_logits"):
        engine.generate(ids, mask, sampling, output_scores=True, output_logits=True)


@pytest.mark.parametrize("layout", [None, "auto"], ids=["static-cache", "block-table"])
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("slots", [None, 2], ids=["static", "continuous"])
def test_the_cache_an_engine_holds_counts_as_available_to_its_next_call(graph, slots, layout):
    """A repeat call reuses the cache the engine holds, and a call of another size releases it
    first: neither may be refused for memory the engine itself took (a llama-8b round of 256
    rows on an 80 GB device was refused at its second call)."""
    model = tiny_model("llama")
    ids, mask = prompts(3)
    sampling = SamplingParams(max_new_tokens=10)
    backend = ScriptedMemory(free=2**40)
    config = RolloutConfig(
        backend=backend,
        enable_graph_capture=graph,
        continuous_batch_size=slots,
        length_buckets=None,
        kv_block_size=layout,
    )
    engine = RolloutEngine(model, config)
    first = engine.generate(ids, mask, sampling)
    held = first.stats.kv_cache_bytes
    block = None if layout is None else backend.capabilities.kv_block_size
    sink = slots is not None  # the continuous path's cache has a sink column after the rows'
    need = request_bytes(
        model, scan_model(model).dtype, slots or 3, 16 + sink, 3, 6, block_size=block
    )
    assert held > 0
    backend.free = need - held  # the device has lost what the engine holds
    again = engine.generate(ids, mask, sampling)
    assert torch.equal(again.sequences, first.sequences)
    assert again.stats.captures == first.stats.captures  # the held step was reused
    longer = SamplingParams(max_new_tokens=40)  # another size: the held cache goes first
    grown = request_bytes(
        model, scan_model(model).dtype, slots or 3, 46 + sink, 3, 6, block_size=block
    )
    backend.free = grown - held
    assert engine.generate(ids, mask, longer).stats.steps > 0
    backend.free = grown - engine.cache.nbytes() - 1
    with pytest.raises(RequestTooLargeError, match=r"available on cpu \(with [0-9.]+ GiB the"):
        engine.generate(ids, mask, longer)


def test_the_request_limit_counts_the_block_tables_whole_blocks():
    """A block table holds whole blocks: 8 rows x 16 columns in blocks of 4096 columns hold
    (8 + 2) x 4096 columns of K/V, which the limit must see (it saw 8 x 16)."""
    model = tiny_model("llama")
    ids, mask = prompts(8, width=6)
    sampling = SamplingParams(max_new_tokens=10)
    static = request_bytes(model, scan_model(model).dtype, 8, 16, 8, 6)
    blocks = request_bytes(model, scan_model(model).dtype, 8, 16, 8, 6, block_size=4096)
    assert blocks > 100 * static
    engine = _engine(model, kv_block_size=4096, max_request_bytes=blocks - 1)
    with pytest.raises(ValueError, match=r"blocks of 4096 columns.*max_request_bytes"):
        engine.generate(ids, mask, sampling)
    served = _engine(model, kv_block_size=4096, max_request_bytes=blocks).generate(
        ids, mask, sampling
    )
    assert served.stats.kv_layout == "blocks" and served.stats.kv_cache_bytes <= blocks
    assert (
        _engine(model, kv_block_size=None, max_request_bytes=static)
        .generate(ids, mask, sampling)
        .stats.kv_layout
        == "static"
    )


# ---- issue 16 cases 1, 2, 3: generate()'s input contract --------------------------------------
def test_missing_mask_is_inferred_from_pad_as_generate_does():
    model = tiny_model("llama")
    ids, mask = prompts(3)  # left-padded with PAD=0, which is not EOS
    got = run(model, ids, None, graph=True, max_new_tokens=6)
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got.sequences[:, : want.shape[1]], want)
    assert torch.equal(got.sequences, run(model, ids, mask, graph=True, max_new_tokens=6).sequences)


def test_missing_mask_with_pad_equal_to_eos_attends_every_token():
    model = tiny_model("llama")
    ids, _ = prompts(2, padded=False)
    ids[:, 0] = EOS
    got = run(model, ids, None, graph=False, max_new_tokens=4, pad_token_id=EOS)
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=EOS)
    assert torch.equal(got.sequences[:, : want.shape[1]], want)


def test_sampling_omitted_follows_the_models_generation_config():
    model = tiny_model("llama", fresh=True)
    model.generation_config.update(do_sample=True, temperature=0.6, top_p=0.9, max_new_tokens=7)
    ids, mask = prompts(3)
    torch.manual_seed(4)
    got = _engine(model, draws="generate").generate(ids, mask)  # generate's own numbers
    torch.manual_seed(4)
    want = generate_padded(model, ids, mask, ids.shape[1] + 7)
    assert torch.equal(got.sequences, want)
    model.generation_config.update(num_beams=3)
    with pytest.warns(UserWarning, match=r"\['num_beams'\].*does not apply"):
        _engine(model).generate(ids, mask)


def test_float_mask_with_weights_is_refused():
    ids, mask = prompts(2)
    soft = mask.float()
    soft[0, -1] = 0.4
    with pytest.raises(ValueError, match=r"only 0 .*and 1"):
        _engine(tiny_model("gpt2")).generate(ids, soft)
    engine = _engine(tiny_model("gpt2"))
    result = engine.generate(ids, mask.float(), SamplingParams(max_new_tokens=2))
    assert result.sequences.shape == (2, 8)


# ---- issue 16 case 9: meta ---------------------------------------------------------------------
def test_meta_inputs_and_meta_parameters_are_refused():
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    with pytest.raises(ValueError, match="input_ids is on the meta device"):
        _engine(model).generate(ids.to("meta"), mask)
    model.lm_head.to("meta")
    with pytest.raises(ValueError, match=r"meta device.*lm_head.weight"):
        _engine(model).generate(ids, mask)


# ---- issue 16 case 10: mixed dtypes, quantized heads ------------------------------------------
def test_bf16_embedding_with_fp32_layers_matches_generate():
    model = tiny_model("llama", fresh=True)
    model.model.embed_tokens.to(torch.bfloat16)
    assert scan_model(model).dtype == torch.float32
    ids, mask = prompts(3)
    want = generate_padded(model, ids, mask, ids.shape[1] + 6, max_new_tokens=6)
    for graph in (False, True):
        got = run(model, ids, mask, graph=graph, max_new_tokens=6)
        assert torch.equal(got.sequences, want)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:torch.quantize_per_tensor")
def test_vocabulary_of_a_quantized_head_comes_from_the_module():
    model = tiny_model("llama", fresh=True)
    quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, torch.qint8)
    assert callable(quantized.lm_head.weight)  # not a tensor: .shape would fail
    assert vocab_size(quantized) == VOCAB
    ids, mask = prompts(2)
    got = run(quantized, ids, mask, graph=False, max_new_tokens=4)
    want = generate_padded(quantized, ids, mask, ids.shape[1] + 4, max_new_tokens=4)
    assert torch.equal(got.sequences, want)


# ---- fuzz: every field and every generate argument --------------------------------------------
BAD_VALUES = [
    None, True, "no", "5", "0.7", 8.5, -1, 0, 10**9, float("nan"), float("inf"), -0.5,
    [], [1.5], (2.5,), "16", object(), np.int64(3), np.float32(0.5), torch.tensor(2),
    torch.tensor([1, 2]), torch.tensor(0.5),
]  # fmt: skip


def _refusal_names(exc: Exception, name: str) -> bool:
    return isinstance(exc, (TypeError, ValueError)) and name in str(exc)


@pytest.mark.parametrize("cls", [SamplingParams, RolloutConfig])
def test_fuzz_every_setting_is_refused_by_name_or_works(cls):
    model = tiny_model("gpt2")
    ids, mask = prompts(2, width=4)
    base = {"max_new_tokens": 2} if cls is SamplingParams else {}
    seen = set()
    for f in dataclasses.fields(cls):
        for value in BAD_VALUES:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    settings = cls(**{**base, f.name: value})
            except Exception as exc:  # the point: which exceptions escape
                assert _refusal_names(exc, f.name), (f.name, value, exc)
                continue
            if repr(settings) in seen:
                continue
            seen.add(repr(settings))
            if cls is SamplingParams:
                params, config = settings, RolloutConfig(backend=CPUBackend())
            else:
                if f.name == "backend":
                    continue  # a backend name other than "cpu" selects another device
                params = SamplingParams(max_new_tokens=3)
                config = dataclasses.replace(settings, backend=CPUBackend())
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    result = RolloutEngine(model, config).generate(ids, mask, params)
            except Exception as exc:
                assert _refusal_names(exc, f.name), (f.name, value, exc)
                continue
            assert result.sequences.shape[0] == 2 * params.num_return_sequences


def test_fuzz_every_generate_argument_is_refused_by_name_or_works():
    model = tiny_model("gpt2")
    ids, mask = prompts(2, width=4)
    engine = _engine(model)
    good = {"input_ids": ids, "attention_mask": mask, "sampling": SamplingParams(max_new_tokens=2)}
    for name in ("input_ids", "attention_mask", "sampling", "generator", "request_max_new_tokens"):
        for value in [*BAD_VALUES, ids.float(), mask[:, :2], mask * 2, ids + VOCAB]:
            kwargs = {**good, name: value}
            try:
                result = engine.generate(**kwargs)
            except Exception as exc:
                assert _refusal_names(exc, name), (name, value, exc)
                continue
            assert result.sequences.shape[0] == 2
