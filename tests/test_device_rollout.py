"""The rollout engine on a real accelerator backend (``GRAPHCAP_BACKEND=cuda``, ``npu``...).

The CPU reference backend runs every graph path in CI; these tests confirm the same claims on a
device: graph == eager == ``generate()`` token for token, sampling equal bitwise for a fixed
seed, reuse across in-place weight updates, and stale graph state dropped before a recapture.
Skipped, with the reason, unless an accelerator backend is selected and available.
"""

from __future__ import annotations

import gc

import pytest
import torch
from rollout_models import PAD, distinct_tokens_per_row, prompts, tiny_model

import graphcap
from graphcap.errors import BackendSelectionError
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams, load_weights_in_place

pytestmark = pytest.mark.device

NEW = 12
NO_EOS = {"eos_token_id": []}


@pytest.fixture(scope="module")
def backend(requested_backend: str | None) -> graphcap.Backend:
    name = requested_backend
    if not name or name == "cpu":
        pytest.skip("device tests need an accelerator backend: set GRAPHCAP_BACKEND=cuda (or npu)")
    try:
        selected = graphcap.get_backend(name)
    except BackendSelectionError as exc:
        pytest.skip(f"backend {name!r} not usable here: {exc}")
    if not selected.capabilities.graph_capture:
        pytest.skip(f"backend {name!r} cannot capture graphs")
    return selected


def on_device(model: torch.nn.Module, backend, dtype=torch.float32) -> torch.nn.Module:
    return model.to(device=backend.device, dtype=dtype)


def run(model, ids, mask, backend, graph: bool, engine=None, draws="per_row", **sampling):
    engine = engine or RolloutEngine(
        model, RolloutConfig(enable_graph_capture=graph, backend=backend, draws=draws)
    )
    return engine.generate(ids, mask, SamplingParams(**sampling))


def generate(model, ids, mask, total: int, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=PAD, **kwargs)
    pad = torch.full((out.shape[0], total - out.shape[1]), PAD, dtype=out.dtype, device=out.device)
    return torch.cat([out, pad], dim=1)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_greedy_graph_equals_eager_equals_generate(backend, family, batch):
    model = on_device(tiny_model(family, fresh=True), backend)
    ids, mask = (t.to(backend.device) for t in prompts(batch, seed=batch))
    total = ids.shape[1] + NEW
    graph = run(model, ids, mask, backend, True, max_new_tokens=NEW, **NO_EOS)
    eager = run(model, ids, mask, backend, False, max_new_tokens=NEW, **NO_EOS)
    reference = generate(
        model, ids, mask, total, max_new_tokens=NEW, do_sample=False, eos_token_id=None
    )
    assert graph.stats.path == "static_graph", graph.stats.fallback_reason
    assert graph.stats.replays == NEW - 1
    assert distinct_tokens_per_row(graph, min_distinct=3)
    assert torch.equal(graph.sequences, eager.sequences)
    assert torch.equal(graph.sequences, reference)


@pytest.mark.parametrize(
    "case",
    [{"top_k": 5}, {"top_p": 0.8, "temperature": 1.3}, {"repetition_penalty": 1.5, "top_k": 20}],
    ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()),
)
def test_sampling_graph_equals_eager_equals_generate(backend, case):
    model = on_device(tiny_model("llama", fresh=True), backend)
    ids, mask = (t.to(backend.device) for t in prompts(4, padded=False, seed=3))
    total = ids.shape[1] + NEW
    outs, states = {}, {}
    for graph in (True, False):
        backend.manual_seed(11)
        outs[graph] = run(  # generate's own random numbers, to compare with generate
            model,
            ids,
            mask,
            backend,
            graph,
            draws="generate",
            do_sample=True,
            max_new_tokens=NEW,
            **case,
        )
        states[graph] = backend.get_rng_state()
    backend.manual_seed(11)
    reference = generate(
        model, ids, mask, total, max_new_tokens=NEW, do_sample=True, **{"top_k": None, **case}
    )
    assert outs[True].stats.path == "static_graph", outs[True].stats.fallback_reason
    assert torch.equal(outs[True].sequences, outs[False].sequences)
    assert torch.equal(states[True], states[False])
    assert torch.equal(outs[True].sequences, reference)


#: Largest |log-prob| difference allowed between a captured half-precision step and the same
#: tokens recomputed by one teacher-forced forward (different kernels round differently).
HALF_LOGPROB_TOLERANCE = {torch.float16: 0.05, torch.bfloat16: 0.25}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_graph_matches_teacher_forced_logprobs(backend, dtype):
    """In half precision near-tied logits may flip free-running tokens, so the graph's chosen
    tokens are scored again by one teacher-forced forward and the log-probs compared within a
    tolerance (free-running equality with the eager loop is printed as information only)."""
    model = on_device(tiny_model("llama", fresh=True), backend, dtype)
    ids, mask = (t.to(backend.device) for t in prompts(8, seed=2))
    params = {"max_new_tokens": NEW, "return_logprobs": True, "logprobs_mode": "raw", **NO_EOS}
    graph = run(model, ids, mask, backend, True, **params)
    assert graph.stats.path == "static_graph", graph.stats.fallback_reason
    width = ids.shape[1]
    full_mask = torch.cat([mask, graph.response_mask.to(mask.dtype)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(graph.sequences, attention_mask=full_mask, position_ids=positions).logits
    forced = torch.log_softmax(logits[:, width - 1 : -1].float(), dim=-1)
    forced = forced.gather(-1, graph.sequences[:, width:, None]).squeeze(-1)
    difference = (forced - graph.logprobs).abs().max().item()
    eager = run(model, ids, mask, backend, False, **params)
    print(
        f"{dtype}: max |log-prob difference| {difference:.4f}; free-running tokens equal to "
        f"eager: {torch.equal(graph.sequences, eager.sequences)}"
    )
    assert difference < HALF_LOGPROB_TOLERANCE[dtype]


@pytest.mark.parametrize("rows", [3, 1])  # 1: the backend's one-row product, where offered
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_compiled_blocks_and_joined_projections_equal_eager_in_fp32(backend, family, rows):
    """compile=True (blocks around attention compiled, then captured) with fuse_projections:
    equal to the plain eager loop in fp32, here token for token; then an in-place update of
    every weight reaches the replayed graph through the joined buffers."""
    if not backend.capabilities.captures_compiled:
        pytest.skip(f"backend {backend.name!r} declares captures_compiled=False")
    model = on_device(tiny_model(family, fresh=True), backend)
    ids, mask = (t.to(backend.device) for t in prompts(rows))
    config = RolloutConfig(
        enable_graph_capture=True, backend=backend, compile=True, fuse_projections=True
    )
    engine = RolloutEngine(model, config)
    params = {"max_new_tokens": NEW, "return_logprobs": True, **NO_EOS}
    fast = run(model, ids, mask, backend, True, engine=engine, **params)
    eager = run(model, ids, mask, backend, False, **params)
    assert fast.stats.path == "static_graph" and fast.stats.compiled, fast.stats.fallback_reason
    assert fast.stats.fused_projections == {"gpt2": 0, "llama": 4, "qwen2": 4}[family]
    assert torch.equal(fast.sequences, eager.sequences)
    assert torch.allclose(fast.logprobs, eager.logprobs, atol=1e-4, rtol=0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    after = run(model, ids, mask, backend, True, engine=engine, **params)
    assert after.stats.captures == 1 and not after.stats.captured
    assert torch.equal(after.sequences, run(model, ids, mask, backend, False, **params).sequences)


@pytest.mark.parametrize(
    "case",
    [
        {"repetition_penalty": 1.3, "min_new_tokens": 4},
        {"do_sample": True, "top_k": 8, "temperature": 0.8},
        {"do_sample": True, "top_p": 0.9, "seed": 5},
    ],
    ids=["greedy-penalty-min-new", "sampled", "seeded"],
)
def test_compiled_sampler_equals_eager_in_fp32(backend, case):
    """compile=True compiles the step's token choice too (inductor, random draws left to eager's
    kernels): in fp32 the captured calls' tokens and the generator's state equal the eager
    loop's, log-probs to rounding."""
    if not backend.capabilities.captures_compiled:
        pytest.skip(f"backend {backend.name!r} declares captures_compiled=False")
    model = on_device(tiny_model("llama", fresh=True), backend)
    ids, mask = (t.to(backend.device) for t in prompts(4, seed=3))
    params = SamplingParams(max_new_tokens=NEW, return_logprobs=True, **NO_EOS, **case)
    outs, states = {}, {}
    for graph in (True, False):
        config = RolloutConfig(enable_graph_capture=graph, backend=backend, compile=graph)
        backend.manual_seed(11)
        outs[graph] = RolloutEngine(model, config).generate(ids, mask, params)
        states[graph] = backend.get_rng_state()
    assert outs[True].stats.path == "static_graph", outs[True].stats.fallback_reason
    assert outs[True].stats.compiled
    assert torch.equal(outs[True].sequences, outs[False].sequences)
    assert torch.allclose(outs[True].logprobs, outs[False].logprobs, atol=1e-4, rtol=0)
    assert torch.equal(states[True], states[False])


def test_in_place_weight_update_reuses_the_graph(backend):
    model = on_device(tiny_model("gpt2", fresh=True), backend)
    ids, mask = (t.to(backend.device) for t in prompts(3))
    engine = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=backend))
    before = run(model, ids, mask, backend, True, engine=engine, max_new_tokens=NEW, **NO_EOS)
    torch.manual_seed(7)
    new_state = {
        k: v + 0.5 * torch.randn_like(v)
        for k, v in model.state_dict().items()
        if v.is_floating_point()
    }
    load_weights_in_place(model, new_state)
    after = run(model, ids, mask, backend, True, engine=engine, max_new_tokens=NEW, **NO_EOS)
    eager = run(model, ids, mask, backend, False, max_new_tokens=NEW, **NO_EOS)
    assert after.stats.captures == 1
    assert not torch.equal(before.sequences, after.sequences)
    assert torch.equal(after.sequences, eager.sequences)


def allocated_after_gc(backend) -> int:
    """Device bytes held by live tensors, after collecting garbage earlier tests left behind."""
    gc.collect()
    backend.synchronize()
    return backend.memory_allocated()


def test_recapture_drops_the_stale_graph_first(backend):
    """A new total length recaptures; device memory does not hold two generations of state."""
    model = on_device(tiny_model("llama", fresh=True), backend)
    # exact lengths: the default length buckets would give 48 and 40 new tokens one graph
    config = RolloutConfig(enable_graph_capture=True, backend=backend, length_buckets=None)
    engine = RolloutEngine(model, config)
    ids, mask = (t.to(backend.device) for t in prompts(8))
    baseline = allocated_after_gc(backend)
    figures = []
    for new in (48, 48, 40, 48):
        result = run(model, ids, mask, backend, True, engine=engine, max_new_tokens=new, **NO_EOS)
        figures.append((result.stats.captures, allocated_after_gc(backend) - baseline))
    print(f"captures and bytes held above the baseline after each call: {figures}")
    assert [c for c, _ in figures] == [1, 1, 2, 3]
    # Each recapture replaces the old state: the bytes held return to the same level.
    assert figures[3][1] == figures[1][1]
    engine.shutdown()
    assert allocated_after_gc(backend) - baseline < figures[1][1]


@pytest.mark.parametrize("fast", [False, True], ids=["plain", "compiled-joined"])
def test_continuous_graph_equals_eager_loop_with_refills(backend, fast):
    """The continuous graph (also with compile=True and fuse_projections) equals the eager
    continuous loop in fp32, refills included."""
    if fast and not backend.capabilities.captures_compiled:
        pytest.skip(f"backend {backend.name!r} declares captures_compiled=False")
    model = on_device(tiny_model("llama", fresh=True), backend)
    ids, mask = (t.to(backend.device) for t in prompts(10, seed=7))
    limits = [3, 9, 5, 12, 4, 7, 11, 6, 8, 10]
    params = SamplingParams(max_new_tokens=12, **NO_EOS)
    outs = {}
    for graph in (True, False):
        config = RolloutConfig(
            enable_graph_capture=graph,
            backend=backend,
            continuous_batch_size=3,
            eos_check_interval=2,
            compile=fast and graph,
            fuse_projections=fast,
        )
        engine = RolloutEngine(model, config)
        outs[graph] = engine.generate(ids, mask, params, request_max_new_tokens=limits)
    assert outs[True].stats.path == "continuous_graph", outs[True].stats.fallback_reason
    assert outs[True].stats.compiled == fast
    assert outs[True].stats.slots_refilled == 7
    # one graph per batch size reached (the live-row ladder, once the queue is empty)
    assert outs[True].stats.captures == len(outs[True].stats.batch_steps)
    assert outs[True].stats.batch_steps == outs[False].stats.batch_steps
    assert torch.equal(outs[True].sequences, outs[False].sequences)
    assert outs[True].response_lengths.tolist() == limits


def test_per_position_graphs_equal_eager(backend):
    model = on_device(tiny_model("gpt2", fresh=True), backend)
    ids, mask = (t.to(backend.device) for t in prompts(3, seed=5))
    pinned = {"max_new_tokens": NEW, "min_new_tokens": NEW, **NO_EOS}
    config = RolloutConfig(enable_graph_capture=True, per_position_graphs=True, backend=backend)
    engine = RolloutEngine(model, config)
    first = engine.generate(ids, mask, SamplingParams(**pinned))
    again = engine.generate(ids, mask, SamplingParams(**pinned))
    eager = run(model, ids, mask, backend, False, **pinned)
    assert first.stats.path == "per_position_graph", first.stats.fallback_reason
    assert again.stats.captures == first.stats.captures == NEW - 1
    assert torch.equal(first.sequences, eager.sequences)
    assert torch.equal(again.sequences, eager.sequences)


# ---- stale host state (issue 10): the PEFT and hook cases on the device, in fp32 -------------
def _recaptures_with_eager_tokens(model, backend, change):
    """Capture, ``change`` host state, call again: a recapture whose tokens equal eager's."""
    ids, mask = (t.to(backend.device) for t in prompts(3))
    engine = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=backend))
    first = run(model, ids, mask, backend, True, engine=engine, max_new_tokens=NEW, **NO_EOS)
    assert first.stats.path == "static_graph", first.stats.fallback_reason
    with change():
        second = run(model, ids, mask, backend, True, engine=engine, max_new_tokens=NEW, **NO_EOS)
        eager = run(model, ids, mask, backend, False, max_new_tokens=NEW, **NO_EOS)
    assert second.stats.captured and second.stats.recapture_reason[0].startswith("host_state")
    assert torch.equal(second.sequences, eager.sequences)
    engine.shutdown()
    return second


def _lora(backend) -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("llama", fresh=True), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    return on_device(model.eval(), backend)


@pytest.mark.parametrize("change", ["disable_adapter", "merge_adapter"])
def test_lora_state_change_after_capture_recaptures(backend, change):
    import contextlib

    model = _lora(backend)

    @contextlib.contextmanager
    def merged():
        model.merge_adapter()
        yield
        model.unmerge_adapter()

    _recaptures_with_eager_tokens(
        model, backend, model.disable_adapter if change == "disable_adapter" else merged
    )


@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook", "global_hook"])
def test_hook_added_after_capture_recaptures(backend, kind):
    import contextlib

    model = on_device(tiny_model("llama", fresh=True), backend)
    mlp = model.model.layers[0].mlp

    def scale(module, args, output):
        return output * 2.5 if module is mlp else None

    def scale_input(module, args):
        return (args[0] * 2.5,)

    @contextlib.contextmanager
    def hooked():
        if kind == "forward_hook":
            handle = mlp.register_forward_hook(scale)
        elif kind == "forward_pre_hook":
            handle = mlp.register_forward_pre_hook(scale_input)
        else:
            handle = torch.nn.modules.module.register_module_forward_hook(scale)
        try:
            yield
        finally:
            handle.remove()

    second = _recaptures_with_eager_tokens(model, backend, hooked)
    # compiled captures of hooked models differed from eager on the H200 (plan.compile_refusal)
    assert not second.stats.compiled and "forward hooks" in second.stats.fallback_reason


def test_recapture_peak_stays_below_two_generations_of_state(backend):
    """During a recapture the old cache and graph are freed before the new ones are allocated,
    so the recapture's peak is the first capture's peak, not that plus the old state (the step's
    own transient memory, e.g. attention over a long bucket, is in both)."""
    model = on_device(tiny_model("llama", fresh=True), backend)
    config = RolloutConfig(enable_graph_capture=True, backend=backend, length_buckets=(8192,))
    engine = RolloutEngine(model, config)
    ids, mask = (t.to(backend.device) for t in prompts(8))
    baseline = allocated_after_gc(backend)
    backend.reset_peak_memory_stats()
    run(model, ids, mask, backend, True, engine=engine, max_new_tokens=4, **NO_EOS)
    first_peak = backend.max_memory_allocated() - baseline
    cache = sum(t.nbytes for layer in engine.cache.layers for t in (layer.keys, layer.values))
    allocated_after_gc(backend)
    backend.reset_peak_memory_stats()
    model.model.rotary_emb.attention_scaling = 1.5  # host-state change: recapture
    result = run(model, ids, mask, backend, True, engine=engine, max_new_tokens=4, **NO_EOS)
    peak = backend.max_memory_allocated() - baseline
    print(f"cache {cache} B; peak above the model: first capture {first_peak}, recapture {peak}")
    assert result.stats.captured and result.stats.recapture_reason
    assert peak < first_peak + cache // 2
    engine.shutdown()


def test_sleep_returns_the_cache_and_graph_memory_every_cycle(backend):
    """A sleep that does not keep the graphs (``sleep_keeps_graphs=False``, or a backend
    without memory regions) frees the cache, buffers and graph memory (not the weights), the
    next call recaptures with the same tokens, and sleep / generate cycles do not grow the
    bytes held (tests/test_device_sleep.py: sleeps that keep the graphs)."""
    from graphcap.rollout.engine import WOKE

    model = on_device(tiny_model("llama", fresh=True), backend)
    config = RolloutConfig(
        enable_graph_capture=True,
        backend=backend,
        length_buckets=(8192,),
        sleep_keeps_graphs=False,
    )
    engine = RolloutEngine(model, config)
    ids, mask = (t.to(backend.device) for t in prompts(8))
    params = {"max_new_tokens": NEW, **NO_EOS}
    baseline = allocated_after_gc(backend)  # the weights
    if baseline is None:
        pytest.skip(f"backend {backend.name!r} reports no allocated bytes")
    first = run(model, ids, mask, backend, True, engine=engine, **params)
    cache = sum(t.nbytes for layer in engine.cache.layers for t in (layer.keys, layer.values))
    awake = allocated_after_gc(backend) - baseline
    asleep = []
    for _ in range(3):
        engine.sleep()
        asleep.append(allocated_after_gc(backend) - baseline)
        again = run(model, ids, mask, backend, True, engine=engine, **params)
        assert again.stats.captured and again.stats.recapture_reason == [WOKE]
        assert torch.equal(again.sequences, first.sequences)
        del again
    print(f"cache {cache} bytes; held above the weights awake {awake}, asleep {asleep}")
    assert first.stats.path == "static_graph", first.stats.fallback_reason
    assert awake >= cache
    # what stays: the result tensors and the capture stream's library workspace (cuBLAS)
    assert asleep[0] <= awake - cache
    assert asleep[1] == asleep[0] and asleep[2] == asleep[0]
    engine.shutdown()
