"""What real torch_npu enforces and graphcap-npu must meet (issue 46), on the torch_npu double.

Each rule is held twice: the double enforces it the way torch_npu does (so a plugin that breaks
it fails here as it would on Ascend), and the plugin meets it, through the engine where the rule
shows there: explicit generators registered with the graph, capture placeholders that fit the
block pool, pools inside int32 range, no graph dispatch mode left behind by a failed capture,
graph updates ordered after the replays before them, the torch_npu version floor and
``TASK_QUEUE_ENABLE=2``.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from typing import ClassVar

import fake_torch_npu
import pytest
import torch
from graphcap_npu import ATTENTION_VAR, BLOCKS, NPUBackend, register_attention
from graphcap_npu.attention import MAX_POOL_ELEMENTS, block_attention_forward, check_pool_size
from graphcap_npu.backend import TASK_QUEUE_VAR
from graphcap_npu.probe import MIN_TORCH_NPU, version_problem
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from graphcap import kv_blocks
from graphcap.cpu import CPUBackend
from graphcap.errors import GraphCaptureError
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.testing import models
from graphcap.testing.conformance import test_decode_step as decode_step

pytestmark = fake_torch_npu.without_real_torch_npu


class HostNPUBackend(NPUBackend):
    """NPUBackend with its tensors on the host (the double has no device memory)."""

    device_type: ClassVar[str] = "cpu"


@pytest.fixture(autouse=True)
def _default_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    monkeypatch.delenv(TASK_QUEUE_VAR, raising=False)


def _blocks_model() -> torch.nn.Module:
    """bf16 llama whose own attention is page attention, so eager steps run the same kernel."""
    register_attention(BLOCKS)
    return models.build("llama", torch.device("cpu"), BLOCKS).to(torch.bfloat16)


def _on_blocks(graph: bool, **config) -> RolloutConfig:
    return RolloutConfig(
        backend=HostNPUBackend(), enable_graph_capture=graph, kv_block_size=16, **config
    )


def _updates(fake_npu) -> list[list[int]]:
    graph = fake_npu.graph_calls[-1]["graph"]
    return [update[0]["actual_seq_lengths_kv"] for update in graph.updates]


# ---- 1. explicit generators, by torch_npu release ---------------------------------------------
OLD_RNG, PER_CAPTURE_RNG = "2.11.0", "2.12.0.post3"


def _version(version: str) -> None:
    sys.modules["torch_npu"].__version__ = version


def test_the_double_refuses_a_draw_from_an_unregistered_generator(fake_npu) -> None:
    """Before 2.12.0.post3 a graph knows the default generator and the registered ones; from
    it every generator is known at its first draw, and registering warns (a deprecated no-op)."""
    _version(OLD_RNG)
    probs = torch.full((2, 8), 0.125)
    generator = torch.Generator().manual_seed(3)
    graph = fake_npu.NPUGraph()
    with (
        pytest.raises(RuntimeError, match="generator not in capture mode"),
        fake_npu.graph(graph, stream=fake_npu.Stream()),
    ):
        torch.multinomial(probs, 1, generator=generator)
    graph = fake_npu.NPUGraph()
    graph.register_generator_state(generator)
    with fake_npu.graph(graph, stream=fake_npu.Stream()):
        torch.multinomial(probs, 1, generator=generator)
        torch.multinomial(probs, 1)  # the default generator is always registered
    _version(PER_CAPTURE_RNG)
    graph = fake_npu.NPUGraph()
    with pytest.warns(UserWarning, match="deprecated"):
        graph.register_generator_state(generator)
    with fake_npu.graph(graph, stream=fake_npu.Stream()):
        torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("version", [OLD_RNG, "2.12.0.post2", PER_CAPTURE_RNG, "2.14.0"])
def test_sampling_from_an_explicit_generator_is_captured(fake_npu, version: str) -> None:
    """The engine registers the caller's generator with the graph where the release needs it
    (and only there: from 2.12.0.post3 it would warn at every capture): the sampled graph path
    runs (no fallback) and draws what the eager loop draws from the same seed."""
    _version(version)
    model = models.build("llama", torch.device("cpu"))
    ids, mask = models.prompts(5, torch.device("cpu"), width=6)
    params = SamplingParams(do_sample=True, max_new_tokens=8, eos_token_id=[])
    config = RolloutConfig(backend=HostNPUBackend(), enable_graph_capture=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*register_generator_state.*deprecated")
        graph = RolloutEngine(model, config).generate(
            ids, mask, params, generator=torch.Generator().manual_seed(7)
        )
    assert graph.stats.path == "static_graph", graph.stats.fallback_reason
    (call,) = fake_npu.graph_calls
    assert len(call["graph"].generators) == (version in (OLD_RNG, "2.12.0.post2"))
    eager = RolloutEngine(
        model, RolloutConfig(backend=CPUBackend(), enable_graph_capture=False)
    ).generate(ids, mask, params, generator=torch.Generator().manual_seed(7))
    assert torch.equal(graph.sequences, eager.sequences)


def _failing_graphs(fake_npu, count: int, where: str = "end") -> None:
    """The next ``count`` captures fail at their begin or end (ACL errors); later ones work
    (counted at capture begin: the engine makes graphs it never captures)."""
    left = [count]

    class Failing(fake_torch_npu.FakeNPUGraph):
        def capture_begin(self, *args, **kwargs) -> None:
            if left[0] > 0:
                left[0] -= 1
                setattr(self, f"fail_at_capture_{where}", "error 507899: capture failed")
            super().capture_begin(*args, **kwargs)

    fake_npu.NPUGraph = Failing


@pytest.mark.parametrize("where", ["begin", "end"])
def test_the_double_leaves_generators_in_capture_mode_after_a_failed_capture(
    fake_npu, where: str
) -> None:
    """torch_npu before 2.12.0.post3: capture_begin flags the graph's generators before ACL
    begins, capture_end clears them only after ACL ended; so after a capture failing at either,
    every draw from them raises, until a capture with them succeeds."""
    _version(OLD_RNG)
    _failing_graphs(fake_npu, 1, where)
    generator = torch.Generator().manual_seed(1)
    graph = fake_npu.NPUGraph()
    graph.register_generator_state(generator)
    with (
        pytest.raises(RuntimeError, match="507899"),
        fake_npu.graph(graph, stream=fake_npu.Stream()),
    ):
        pass
    for draw in (lambda: torch.rand(2), lambda: torch.rand(2, generator=generator)):
        with pytest.raises(RuntimeError, match="Offset increment outside graph capture"):
            draw()
    torch.rand(2, generator=torch.Generator())  # a generator the graph did not know
    clearing = fake_npu.NPUGraph()
    clearing.register_generator_state(generator)
    with fake_npu.graph(clearing, stream=fake_npu.Stream()):
        pass
    torch.rand(2), torch.rand(2, generator=generator)
    _version(PER_CAPTURE_RNG)
    _failing_graphs(fake_npu, 1, where)
    with (
        pytest.raises(RuntimeError, match="507899"),
        fake_npu.graph(fake_npu.NPUGraph(), stream=fake_npu.Stream()),
    ):
        pass
    torch.rand(2)


@pytest.mark.parametrize("version", [OLD_RNG, PER_CAPTURE_RNG])
def test_after_a_failed_sampled_capture_every_generator_draws(fake_npu, version: str) -> None:
    """The capture of a sampled call fails (at capture end): the call finishes eagerly with
    eager's tokens, the caller's generator and the default one draw again, and the next sampled
    call captures (on 2.11 the backend ran one trivial capture with the same generators)."""
    _version(version)
    _failing_graphs(fake_npu, 1)
    model = models.build("llama", torch.device("cpu"))
    ids, mask = models.prompts(3, torch.device("cpu"), width=6)
    params = SamplingParams(do_sample=True, max_new_tokens=5, eos_token_id=[])
    config = RolloutConfig(backend=HostNPUBackend(), enable_graph_capture=True)
    generator = torch.Generator().manual_seed(11)
    with pytest.warns(match="507899"):
        result = RolloutEngine(model, config).generate(ids, mask, params, generator=generator)
    assert result.stats.path == "eager" and "507899" in result.stats.fallback_reason
    eager = RolloutEngine(
        model, RolloutConfig(backend=CPUBackend(), enable_graph_capture=False)
    ).generate(ids, mask, params, generator=torch.Generator().manual_seed(11))
    assert torch.equal(result.sequences, eager.sequences)
    torch.rand(2), torch.rand(2, generator=generator)
    again = RolloutEngine(model, config).generate(ids, mask, params, generator=generator)
    assert again.stats.path == "static_graph", again.stats.fallback_reason


def test_when_the_clearing_capture_fails_too_the_error_says_restart(fake_npu) -> None:
    _version(OLD_RNG)
    _failing_graphs(fake_npu, 2)
    backend = HostNPUBackend()
    with (
        pytest.raises(GraphCaptureError, match="Restart the process") as failed,
        backend.capture_to_graph(backend.create_graph()),
    ):
        pass
    assert "507899" in str(failed.value.__cause__)
    with pytest.raises(RuntimeError, match="Offset increment outside graph capture"):
        torch.rand(2)


def test_conformance_decode_step_with_an_explicit_generator_passes(fake_npu) -> None:
    decode_step.test_engine_decode_step_replays_give_eager_tokens(HostNPUBackend(), "llama", True)


# ---- 2. capture placeholders and page attention's block count ---------------------------------
def test_paged_graph_with_rows_of_several_blocks_is_captured_and_equals_eager(fake_npu) -> None:
    """Batch 6, rows of 4 blocks, the pool grown twice before the last capture: the capture's
    placeholder lengths must fit the pool as it is (the double refuses lengths needing more
    blocks than it holds, as page attention does), else every capture fails and the call runs
    eagerly. On the continuous path, whose pools grow with the rows (the static path's is
    sized for its bucket from the start)."""
    model = _blocks_model()
    ids, mask = models.prompts(6, torch.device("cpu"), width=20, seed=5)
    params = SamplingParams(max_new_tokens=40, eos_token_id=[])
    slots = {"continuous_batch_size": 6}
    result = RolloutEngine(model, _on_blocks(True, **slots)).generate(ids, mask, params)
    stats = result.stats
    assert stats.path == "continuous_graph", stats.fallback_reason
    assert stats.fallback_reason is None
    assert stats.kv_pool_growths >= 2 and stats.captures >= 2
    assert stats.kv_blocks_held >= 6 * 4  # every row reached its fourth block
    eager = RolloutEngine(model, _on_blocks(False, **slots)).generate(ids, mask, params)
    assert torch.equal(result.sequences, eager.sequences)
    assert len(set(result.sequences[:, 20:].flatten().tolist())) > 3


# ---- 3. the int32 pool limit ------------------------------------------------------------------
def _pool(blocks: int) -> torch.Tensor:
    """A (blocks, 8, 128, 128) bf16 pool that takes no memory (one element, expanded)."""
    return torch.zeros(1, dtype=torch.bfloat16).expand(blocks, 8, 128, 128)


def test_pools_beyond_int32_range_are_refused_with_the_way_out(fake_npu) -> None:
    """8 K/V heads of 128 in 128-column blocks: 16,383 blocks fit, 16,384 do not; the plugin
    refuses before the kernel is called."""
    assert 16383 * 8 * 128 * 128 <= MAX_POOL_ELEMENTS < 16384 * 8 * 128 * 128
    check_pool_size(_pool(16383))
    query = torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16)
    view = kv_blocks.BlockView(
        table=torch.ones(1, 64, dtype=torch.int32),
        lengths=torch.tensor([8192], dtype=torch.int32),
        block_size=128,
    )
    pool = _pool(16384)
    with (
        kv_blocks.reading_blocks(view),
        pytest.raises(ValueError, match=r"16384 blocks .*at most 16383 .*fewer rows"),
    ):
        block_attention_forward(torch.nn.Module(), query, pool, pool, None)
    assert fake_torch_npu.INFER_CALLS == []


def test_the_double_refuses_pools_beyond_int32_range(fake_npu) -> None:
    pool = _pool(16384)
    with pytest.raises(RuntimeError, match="int32"):
        fake_torch_npu.npu_fused_infer_attention_score(
            torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16),
            pool,
            pool,
            actual_seq_lengths_kv=[8192],
            block_table=torch.ones(1, 64, dtype=torch.int32),
            block_size=128,
            num_heads=8,
            input_layout="BNSD",
        )


# ---- 4. the graph dispatch mode after a failed capture ----------------------------------------
def _graph_modes() -> list[object]:
    return [
        mode
        for mode in _get_current_dispatch_mode_stack()
        if isinstance(mode, fake_torch_npu.FakeGraphDispatchMode)
    ]


def test_failed_capture_leaves_no_graph_dispatch_mode(fake_npu) -> None:
    """No capture runs whole under the dispatch mode, so a failed one cannot leave it on."""
    backend = NPUBackend()
    graph = backend.create_graph()
    graph.fail_at_capture_end = "error 507899: capture failed"
    during = []
    with pytest.raises(GraphCaptureError, match="507899"), backend.capture_to_graph(graph):
        during += _graph_modes()
    assert during == [] and _graph_modes() == []
    assert backend.current_stream() is fake_npu.default


def test_the_double_breaks_infer_attention_under_a_stale_dispatch_mode(fake_npu) -> None:
    """torch_npu's graph.__exit__ skips the pop when capture_end raises; the double then fails
    the next infer-attention call, as its handler would on a stream that is not capturing."""
    graph = fake_npu.NPUGraph()
    graph.fail_at_capture_end = "error 507899: capture failed"
    with (
        pytest.raises(RuntimeError, match="507899"),
        fake_npu.graph(graph, stream=fake_npu.Stream(), auto_dispatch_capture=True),
    ):
        pass
    try:
        q = torch.randn(1, 2, 1, 16, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="not capturing"):
            fake_torch_npu.npu_fused_infer_attention_score(q, q, q, num_heads=2)
    finally:
        graph.graph_dispatch_mode.__exit__(None, None, None)


class _FailingGraph(fake_torch_npu.FakeNPUGraph):
    def __init__(self) -> None:
        super().__init__()
        self.fail_at_capture_end = "error 507899: capture failed"


def test_eager_fallback_after_a_failed_capture_equals_eager(fake_npu) -> None:
    """The engine's fallback after capture_end fails runs page attention eagerly: with the
    dispatch mode left on, every one of those calls would fail."""
    fake_npu.NPUGraph = _FailingGraph
    model = _blocks_model()
    ids, mask = models.prompts(5, torch.device("cpu"), width=6)
    params = SamplingParams(max_new_tokens=6, eos_token_id=[])
    with pytest.warns(match="507899"):
        result = RolloutEngine(model, _on_blocks(True)).generate(ids, mask, params)
    assert result.stats.path == "eager" and "507899" in result.stats.fallback_reason
    eager = RolloutEngine(model, _on_blocks(False)).generate(ids, mask, params)
    assert torch.equal(result.sequences, eager.sequences)
    assert _graph_modes() == []


# ---- 5. update and replay ordering ------------------------------------------------------------
def test_the_double_hangs_a_replay_that_nothing_updated(fake_npu) -> None:
    """torch_npu records, under the dispatch mode, every infer-attention call and v3 outside
    BNSD on CANN 9.1 or later; each record's replay waits for an update since the last one."""
    q = torch.randn(1, 2, 1, 16, dtype=torch.bfloat16)
    bsh = q.view(1, 1, 32)
    graph = fake_npu.NPUGraph()
    with fake_npu.graph(graph, stream=fake_npu.Stream(), auto_dispatch_capture=True):
        fake_torch_npu.npu_fused_infer_attention_score(q, q, q, num_heads=2, input_layout="BNSD")
        fake_torch_npu.npu_fusion_attention_v3(q, q, q, 2, "BNSD")  # BNSD: no record
        fake_torch_npu.npu_fusion_attention_v3(bsh, bsh, bsh, 2, "BSH")
    assert graph.dispatch_records == [None, None]  # no lengths: neither call passed any
    with pytest.raises(RuntimeError, match="device hangs"):
        graph.replay()
    graph.update(cpu_update_input=[{}])
    graph.replay()
    with pytest.raises(RuntimeError, match="device hangs"):
        graph.replay()
    fake_npu.cann_9_1 = False  # before CANN 9.1 torch_npu's v3 handler stands aside
    graph = fake_npu.NPUGraph()
    with fake_npu.graph(graph, stream=fake_npu.Stream(), auto_dispatch_capture=True):
        fake_torch_npu.npu_fusion_attention_v3(bsh, bsh, bsh, 2, "BSH")
    assert graph.dispatch_records == []
    graph.replay()


def test_the_double_refuses_an_update_that_may_overtake_a_replay(fake_npu) -> None:
    graph = fake_npu.NPUGraph()
    with fake_npu.graph(graph, stream=fake_npu.Stream(), auto_dispatch_capture=True):
        pass
    graph.update(cpu_update_input=[{}])
    graph.replay()
    with pytest.raises(RuntimeError, match="overtake"):
        graph.update(cpu_update_input=[{}])
    fake_npu.synchronize()
    graph.update(cpu_update_input=[{}])


def test_each_update_follows_the_replay_before_it(fake_npu) -> None:
    backend = NPUBackend()
    graph = backend.create_graph()
    with backend.capture_to_graph(graph):
        pass
    for lengths in ([3, 8], [4, 9], [1, 5]):
        backend.update_graph_kv_lengths(graph, lengths)
        backend.replay_graph(graph)
    assert graph.replays == 3


def test_continuous_retire_and_refill_inside_one_check_interval(fake_npu) -> None:
    """Six slots of 16-column blocks, eight requests: slots retire and are refilled within the
    first ``eos_check_interval`` steps, a retired slot's row starts again shorter, and every
    update reaches the graph after the replay before it; tokens equal eager steps."""
    model = _blocks_model()
    ids, mask = models.prompts(8, torch.device("cpu"), width=12, seed=9)
    params = SamplingParams(max_new_tokens=40, eos_token_id=[])
    limits = [2, 40, 7, 35, 5, 30, 9, 25]
    # the full size's graph only (the live-row ladder's sizes are graphs of their own)
    config = {"continuous_batch_size": 6, "eos_check_interval": 16, "batch_ladder": None}
    result = RolloutEngine(model, _on_blocks(True, **config)).generate(
        ids, mask, params, request_max_new_tokens=limits
    )
    stats = result.stats
    assert stats.path == "continuous_graph", stats.fallback_reason
    assert stats.slots_refilled == 2 and stats.kv_blocks_held > 6 * 2
    updates = _updates(fake_npu)
    drops = [
        index
        for index, (before, after) in enumerate(itertools.pairwise(updates))
        if any(b > a for b, a in zip(before, after, strict=True))
    ]
    assert drops and drops[0] < 15, "no slot was refilled inside the first check interval"
    eager = RolloutEngine(model, _on_blocks(False, **config)).generate(
        ids, mask, params, request_max_new_tokens=limits
    )
    assert torch.equal(result.sequences, eager.sequences)


# ---- 6. versions and TASK_QUEUE_ENABLE --------------------------------------------------------
@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("2.5.1.post1", False),
        ("2.9.0", False),
        ("2.10.0.post7", False),
        ("2.11.0", True),
        ("2.14.0", True),
        ("2.11.0rc1", True),
        ("unknown", False),
    ],
)
def test_torch_npu_older_than_the_floor_makes_the_backend_unavailable(
    fake_npu, version: str, ok: bool
) -> None:
    sys.modules["torch_npu"].__version__ = version
    availability = NPUBackend.availability()
    assert availability.ok is ok, availability.reason
    assert (version_problem(version) is None) is ok
    if not ok:
        assert "2.11.0" in availability.reason and version in availability.reason
    assert MIN_TORCH_NPU == (2, 11, 0)


def test_the_double_refuses_capture_under_task_queue_2(fake_npu, monkeypatch) -> None:
    monkeypatch.setenv(TASK_QUEUE_VAR, "2")
    with (
        pytest.raises(RuntimeError, match="TASK_QUEUE_ENABLE = 2"),
        fake_npu.graph(fake_npu.NPUGraph(), stream=fake_npu.Stream()),
    ):
        pass


def test_task_queue_2_is_named_and_the_call_runs_eagerly(fake_npu, monkeypatch) -> None:
    monkeypatch.setenv(TASK_QUEUE_VAR, "2")
    backend = NPUBackend()
    with pytest.raises(GraphCaptureError, match="start the process with TASK_QUEUE_ENABLE=1"):
        backend.capture_to_graph(backend.create_graph())
    model = _blocks_model()
    ids, mask = models.prompts(3, torch.device("cpu"), width=6)
    params = SamplingParams(max_new_tokens=4, eos_token_id=[])
    with pytest.warns(match="TASK_QUEUE_ENABLE"):
        result = RolloutEngine(model, _on_blocks(True)).generate(ids, mask, params)
    assert result.stats.path == "eager"
    assert "start the process with TASK_QUEUE_ENABLE=1" in result.stats.fallback_reason
    assert _graph_modes() == []
