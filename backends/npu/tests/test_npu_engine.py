"""RolloutEngine end to end on the NPU backend, with torch_npu replaced by its CPU double.

The backend under test is NPUBackend itself (its capabilities, graph hooks, side stream and
attention offer), only placed on the host: the double's NPUGraph records into graphcap's CPU
graph, so a replay really re-runs the captured kernels, and its attention kernels follow
torch_npu's documented semantics (True = masked out, NaN for an uncorrected empty row).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from typing import ClassVar

import fake_torch_npu
import pytest
import torch
from graphcap_npu import (
    ATTENTION_VAR,
    BLOCKS,
    FA3_BNSD,
    FA3_BSH,
    FIAS_BNSD,
    FIAS_BSH,
    NPUBackend,
    register_attention,
)
from graphcap_npu.attention import PLACEHOLDER_LENGTH

from graphcap.cpu import CPUBackend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.testing import models
from graphcap.testing.conformance import test_half_precision as half_precision
from graphcap.testing.conformance import test_kv_blocks as kv_checks

pytestmark = fake_torch_npu.without_real_torch_npu

NEW = 10


class HostNPUBackend(NPUBackend):
    """NPUBackend with its tensors on the host (the double has no device memory)."""

    device_type: ClassVar[str] = "cpu"


def _llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = models.build("llama", torch.device("cpu")).to(dtype)  # 4 query heads, 2 K/V heads
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    return model


def _eager(model, ids, mask, params, **config):
    config = {"enable_graph_capture": False, **config}
    engine = RolloutEngine(model, RolloutConfig(backend=CPUBackend(), **config))
    return engine.generate(ids, mask, params)


def _calls(name: str, dtype: torch.dtype) -> list[dict]:
    if name in (FIAS_BSH, FIAS_BNSD) or (name == BLOCKS and dtype != torch.float32):
        return fake_torch_npu.INFER_CALLS
    return fake_torch_npu.FUSION_CALLS


@pytest.mark.parametrize(
    ("attention", "dtype"),
    [
        (None, torch.float32),  # the backend's default: paged; fp32 reads gathered K/V with v3
        (None, torch.bfloat16),  # page attention over the block table
        (FA3_BSH, torch.float32),
        (FA3_BNSD, torch.float32),
        (FIAS_BSH, torch.bfloat16),  # the inference kernel has no fp32
        (FIAS_BNSD, torch.bfloat16),
    ],
)
def test_static_graph_through_the_plugin_attention_equals_eager_sdpa(
    fake_npu, monkeypatch: pytest.MonkeyPatch, attention: str | None, dtype: torch.dtype
) -> None:
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    backend = HostNPUBackend(attention=attention)
    name = attention or BLOCKS
    model = _llama(dtype)
    ids, mask = models.prompts(4, torch.device("cpu"), width=6)  # rows 1 and 3 left-padded
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
    engine = RolloutEngine(model, RolloutConfig(backend=backend, enable_graph_capture=True))
    result = engine.generate(ids, mask, params)
    assert result.stats.path == "static_graph", result.stats.fallback_reason
    assert result.stats.attention == name
    assert result.stats.replays == NEW - 1
    # only page attention's calls wait at each replay for the update the engine issues; every
    # other kernel (the double records v3 in BSH as torch_npu does on CANN 9.1) is plain
    (call,) = fake_npu.graph_calls
    paged = name == BLOCKS and dtype != torch.float32
    assert bool(call["graph"].dispatch_records) is paged
    assert len(call["graph"].updates) == (NEW - 1 if paged else 0)
    calls = _calls(name, dtype)
    assert calls, f"{name} was never called"
    assert {c["input_layout"] for c in calls} == {"BSH" if name in (FA3_BSH, FIAS_BSH) else "BNSD"}
    assert {c["inner_precise"] for c in calls} == {0}  # decode rows are never empty
    # restored after capture (private: transformers has no public getter for it)
    assert model.config._attn_implementation == "sdpa"
    expected = _eager(model, ids, mask, params)
    assert torch.equal(result.sequences, expected.sequences)
    assert len(set(result.sequences[:, 6:].flatten().tolist())) > 3  # tokens vary


def test_continuous_graph_with_idle_slots_equals_eager(fake_npu, monkeypatch) -> None:
    """Idle and finished slots write into the sink column and attend to it, so no decode row is
    ever empty: the kernel runs without invalid-row correction, and the double (NaN for an
    uncorrected empty row) still gives eager's tokens."""
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    empty_row_seen = _watch_for_empty_rows(monkeypatch)
    model = _llama()
    ids, mask = models.prompts(5, torch.device("cpu"), width=5, seed=3)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
    limits = [3, 9, 2, 10, 5]  # slots free up at different steps, the queue runs dry
    graph_config = RolloutConfig(
        backend=HostNPUBackend(), enable_graph_capture=True, continuous_batch_size=3
    )
    result = RolloutEngine(model, graph_config).generate(
        ids, mask, params, request_max_new_tokens=limits
    )
    assert result.stats.path == "continuous_graph", result.stats.fallback_reason
    assert result.stats.attention == BLOCKS  # fp32: v3 (BNSD) on gathered K/V
    assert fake_torch_npu.FUSION_CALLS
    assert {c["inner_precise"] for c in fake_torch_npu.FUSION_CALLS} == {0}
    eager = RolloutEngine(
        model,
        RolloutConfig(backend=CPUBackend(), continuous_batch_size=3, enable_graph_capture=False),
    ).generate(ids, mask, params, request_max_new_tokens=limits)
    assert torch.equal(result.sequences, eager.sequences)
    assert not empty_row_seen.item(), "a decode row had nothing to attend to"


def _watch_for_empty_rows(monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """A flag the v3 kernel sets (on the device, so also in replays) when a row of its mask is
    fully masked out."""
    import sys

    seen = torch.zeros((), dtype=torch.bool)
    kernel = fake_torch_npu.npu_fusion_attention_v3

    def watched(*args, atten_mask=None, **kwargs):
        if atten_mask is not None:
            seen.logical_or_(atten_mask.all(dim=-1).any())
        return kernel(*args, atten_mask=atten_mask, **kwargs)

    monkeypatch.setattr(sys.modules["torch_npu"], "npu_fusion_attention_v3", watched)
    return seen


def test_graph_attention_none_keeps_the_model_attention(fake_npu, monkeypatch) -> None:
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    model = _llama()
    ids, mask = models.prompts(2, torch.device("cpu"))
    params = SamplingParams(max_new_tokens=4, eos_token_id=[])
    config = RolloutConfig(
        backend=HostNPUBackend(), enable_graph_capture=True, graph_attention=None
    )
    result = RolloutEngine(model, config).generate(ids, mask, params)
    assert result.stats.path == "static_graph"
    assert result.stats.attention == "sdpa"
    assert fake_torch_npu.FUSION_CALLS == []


def _updates(fake_npu) -> list[list[int]]:
    """The lengths each update of the last captured graph set (one dict for every record)."""
    graph = fake_npu.graph_calls[-1]["graph"]
    assert all(len(update) == 1 for update in graph.updates)
    return [update[0]["actual_seq_lengths_kv"] for update in graph.updates]


def _on_blocks(graph: bool, **config) -> RolloutConfig:
    return RolloutConfig(backend=HostNPUBackend(), enable_graph_capture=graph, **config)


def _blocks_model() -> torch.nn.Module:
    """bf16 llama whose own attention is the block one, so eager steps run it too (the eager
    path keeps the model's attention): graph and eager then run the same kernel on one layout
    and must agree bit for bit, which bf16 SDPA on a static cache need not."""
    register_attention(BLOCKS)
    model = models.build("llama", torch.device("cpu"), BLOCKS).to(torch.bfloat16)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    return model


def test_paged_static_graph_reads_the_table_with_lengths_set_before_each_replay(
    fake_npu, monkeypatch
) -> None:
    """bf16 decode steps run page attention over the pools (the block table, block size 128,
    no K/V copy); the capture records placeholder lengths and every replay is preceded by an
    update carrying each row's written columns; tokens equal eager steps (host lengths)."""
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    model = _blocks_model()
    ids, mask = models.prompts(4, torch.device("cpu"), width=6)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
    result = RolloutEngine(model, _on_blocks(True)).generate(ids, mask, params)
    stats = result.stats
    assert stats.path == "static_graph" and stats.kv_layout == "blocks", stats.fallback_reason
    decode = [c for c in fake_torch_npu.INFER_CALLS if c["block_table"] is not None]
    assert decode, "page attention never ran"
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    for call in decode:
        assert call["block_size"] == 128 and call["input_layout"] == "BNSD"
        assert call["key_shape"][1:] == (heads, 128, dim)  # the pool itself, not a gather
        assert call["block_table"].dtype == torch.int32
    lengths = {tuple(c["actual_seq_lengths_kv"]) for c in decode}
    assert (PLACEHOLDER_LENGTH,) * 4 in lengths  # the capture's placeholders, which fit any pool
    width = ids.shape[1]
    # replays decode tokens 2..NEW (the first came from the prefill); each writes one column
    expected = [[width + step + 1] * 4 for step in range(NEW - 1)]
    assert len(_updates(fake_npu)) == stats.replays
    assert _updates(fake_npu) == expected[-stats.replays :]
    fake_torch_npu.INFER_CALLS.clear()
    eager = RolloutEngine(model, _on_blocks(False)).generate(ids, mask, params)
    assert eager.stats.kv_layout == "blocks"
    assert {tuple(c["actual_seq_lengths_kv"]) for c in fake_torch_npu.INFER_CALLS} >= {
        tuple(row) for row in expected
    }  # eager steps read the same lengths off the device
    assert torch.equal(result.sequences, eager.sequences)
    assert len(set(result.sequences[:, width:].flatten().tolist())) > 3  # tokens vary


def test_paged_continuous_graph_refills_and_equals_eager(fake_npu, monkeypatch) -> None:
    """bf16, 16-column blocks, more requests than slots: rows take new blocks as they grow and
    retired slots' blocks go to newcomers; each replay gets its rows' lengths (a refilled slot's
    start again from its prompt), tokens equal eager steps on the same table."""
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    model = _blocks_model()
    ids, mask = models.prompts(5, torch.device("cpu"), width=5, seed=3)
    params = SamplingParams(max_new_tokens=30, eos_token_id=[])
    limits = [3, 30, 12, 26, 5]
    # exact lengths: a bucket's longer rows would grow the pool and recapture mid-call, and
    # this test reads the first replays of the one graph (no live-row ladder: its smaller
    # sizes are graphs of their own)
    blocks = {
        "continuous_batch_size": 3,
        "kv_block_size": 16,
        "length_buckets": None,
        "batch_ladder": None,
    }
    result = RolloutEngine(model, _on_blocks(True, **blocks)).generate(
        ids, mask, params, request_max_new_tokens=limits
    )
    stats = result.stats
    assert stats.path == "continuous_graph", stats.fallback_reason
    assert stats.slots_refilled > 0 and stats.kv_blocks_held > 3
    assert any(c["block_table"] is not None for c in fake_torch_npu.INFER_CALLS)
    updates = _updates(fake_npu)
    assert updates and all(len(lengths) == 3 for lengths in updates)
    assert updates[0] == [ids.shape[1] + 1] * 3  # the first replay: each row's first new column
    refills = [
        slot
        for before, after in itertools.pairwise(updates)
        for slot in range(3)
        if after[slot] < before[slot]
    ]
    assert refills, "no replay saw a refilled slot's shorter row"
    eager = RolloutEngine(model, _on_blocks(False, **blocks)).generate(
        ids, mask, params, request_max_new_tokens=limits
    )
    assert torch.equal(result.sequences, eager.sequences)


def test_paged_continuous_graph_on_the_ladder_gets_each_sizes_lengths(fake_npu, monkeypatch):
    """Once the queue is empty the slots move down the live-row ladder (budgets 10, 6, 5, 5 in
    3 slots: the third slot's request moves to the second after step 5): each size's graph is
    handed one length per row it runs, the moved row's own, and tokens equal the eager loop's
    and the unmoved run's."""
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    model = _blocks_model()
    ids, mask = models.prompts(4, torch.device("cpu"), width=5, seed=3)
    params = SamplingParams(max_new_tokens=10, eos_token_id=[])
    limits = [10, 6, 5, 5]
    blocks = {"continuous_batch_size": 3, "kv_block_size": 16, "length_buckets": None}
    outs, graphs = {}, []
    for graph, ladder in ((True, "auto"), (False, "auto"), (True, None)):
        config = _on_blocks(graph, batch_ladder=ladder, **blocks)
        outs[graph, ladder] = RolloutEngine(model, config).generate(
            ids, mask, params, request_max_new_tokens=limits
        )
        if ladder and graph:  # the graphs of sizes 3, 2 and 1, in the order the call ran them
            graphs = [call["graph"] for call in fake_npu.graph_calls[-3:]]
    result = outs[True, "auto"]
    assert result.stats.path == "continuous_graph", result.stats.fallback_reason
    assert result.stats.batch_steps == {3: 5, 2: 3, 1: 1} and result.stats.rows_moved == 1
    sizes = [{len(update[0]["actual_seq_lengths_kv"]) for update in g.updates} for g in graphs]
    assert sizes == [{3}, {2}, {1}]
    # the moved request (budget 5, second place from step 6) wrote columns 9-12 of its row
    width = ids.shape[1]
    assert [u[0]["actual_seq_lengths_kv"] for u in graphs[1].updates] == [
        [width + 6 + i, width + 2 + i] for i in range(3)
    ]
    assert torch.equal(result.sequences, outs[False, "auto"].sequences)
    assert torch.equal(result.sequences, outs[True, None].sequences)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", [BLOCKS, FA3_BSH, FA3_BNSD, FIAS_BSH, FIAS_BNSD])
def test_half_precision_conformance_check_passes_every_npu_attention(
    fake_npu, name: str, dtype: torch.dtype
) -> None:
    """The conformance suite's half-precision check, on the double: page attention through the
    block table with lengths updated before each replay, and the dense kernels."""
    register_attention(name)
    fake_torch_npu.INFER_CALLS.clear()
    half_precision.check_attention(HostNPUBackend(), name, dtype)
    if name == BLOCKS:
        paged = [c for c in fake_torch_npu.INFER_CALLS if c["block_table"] is not None]
        # eager, the capture's warm-up (host lengths) and the capture (placeholders)
        assert [c["actual_seq_lengths_kv"] for c in paged] == [[384, 253, 5]] * 2 + [
            [PLACEHOLDER_LENGTH] * 3
        ]
        graph = fake_npu.graph_calls[-1]["graph"]
        assert [u[0]["actual_seq_lengths_kv"] for u in graph.updates] == [
            [384, 253, 5],
            [129, 384, 1],
        ]


def test_block_table_conformance_checks_pass_on_the_double(fake_npu, monkeypatch) -> None:
    """The conformance suite's block-table checks, run on NPUBackend over the double (fp32:
    the block attention reads gathered K/V with v3; the host lengths still reach every replay)."""
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    backend = HostNPUBackend()
    kv_checks.test_host_lengths_reach_the_backend_before_every_replay(backend, monkeypatch)
    kv_checks.test_block_table_graph_equals_eager_with_growth_and_refills(backend, "llama")


def test_half_precision_check_fails_when_an_update_is_skipped(fake_npu, monkeypatch) -> None:
    """Planted bug: only the first update reaches the graph. On torch_npu the second replay
    would wait forever for the update's event; the backend refuses it instead."""
    register_attention(BLOCKS)
    backend = HostNPUBackend()
    update = backend.update_graph_kv_lengths
    done: list[list[int]] = []

    def first_only(graph, lengths):
        if not done:
            update(graph, lengths)
        done.append(lengths)

    monkeypatch.setattr(backend, "update_graph_kv_lengths", first_only)
    with pytest.raises(RuntimeError, match="update_graph_kv_lengths before every replay"):
        half_precision.check_attention(backend, BLOCKS, torch.bfloat16)


def _train_step(model: torch.nn.Module, sequences: torch.Tensor) -> None:
    """One SGD step of next-token loss on the round's rows (in place, as an optimizer's)."""
    model.train()
    logits = model(input_ids=sequences).logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), sequences[:, 1:].reshape(-1)
    )
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.5)
            p.grad = None
    model.eval()


@pytest.mark.parametrize(
    ("dtype", "config"),
    [
        (torch.float32, {}),  # v3 over gathered K/V: graphs that wait for no update
        (torch.bfloat16, {}),  # page attention: each replay of the new graph gets its update
        (torch.float32, {"continuous_batch_size": 3}),
    ],
    ids=["static-fp32", "static-paged", "continuous"],
)
def test_a_sleep_frees_and_the_next_round_captures_again(fake_npu, monkeypatch, dtype, config):
    """No memory region on NPU (docs/npu.md, "Sleep and memory regions"): every sleep of a
    training loop frees the buffers and graphs and empties torch_npu's cache, and the next
    round captures new graphs, with "woke from sleep" as the reason; its tokens equal those of
    an engine on the same backend that never slept, after the same training steps."""
    from graphcap.rollout.engine import WOKE

    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    backend = HostNPUBackend()
    model = _blocks_model() if dtype == torch.bfloat16 else _llama()
    twin = copy.deepcopy(model)
    settings = RolloutConfig(backend=backend, enable_graph_capture=True, **config)
    engine, reference = RolloutEngine(model, settings), RolloutEngine(twin, settings)
    ids, mask = models.prompts(4, torch.device("cpu"), width=6)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
    first = engine.generate(ids, mask, params)
    reference.generate(ids, mask, params)
    path = first.stats.path
    assert path.endswith("graph") and first.stats.recapture_reason == [], first.stats
    captures = first.stats.captures
    for i in range(3):
        graphs = len(fake_npu.graph_calls)
        fake_npu.memory_calls.clear()
        engine.sleep()
        assert not engine.last_sleep.kept_graphs and engine.cache is None
        assert ("empty_cache", None) in fake_npu.memory_calls
        _train_step(model, first.sequences)
        _train_step(twin, first.sequences)
        again = engine.generate(ids, mask, params)
        expected = reference.generate(ids, mask, params)
        stats = again.stats
        assert stats.path == path and stats.recapture_reason == [WOKE], stats
        assert stats.captures == (i + 2) * captures
        new = fake_npu.graph_calls[graphs:]  # the engine's (the reference captures no more)
        assert all(call["graph"].replays for call in new), "a recaptured graph never replayed"
        if dtype == torch.bfloat16:  # each replay of the new graph was preceded by an update
            (call,) = new
            assert len(call["graph"].updates) == NEW - 1
        assert not expected.stats.captured  # the reference never slept: it only replays
        assert torch.equal(again.sequences, expected.sequences), f"iteration {i}"
    assert torch.equal(again.sequences[:, :6], ids)


def test_the_drop_in_keeps_its_engine_between_calls_on_npu(fake_npu, monkeypatch) -> None:
    """Without a region a sleep after every call would recapture every call, so the drop-in
    does not sleep between calls on NPU by default (docs/trainers.md gives the option)."""
    from graphcap.rollout import accelerate_generate, restore_generate

    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    model = _llama()
    installed = accelerate_generate(model, RolloutConfig(backend=HostNPUBackend()))
    try:
        assert not installed.sleep_between_calls
    finally:
        restore_generate(model)


def test_tensor_parallel_drop_in_calls_go_to_generate_on_npu(fake_npu, monkeypatch, tmp_path):
    """NPU declares collectives_in_graph=False: with a process group the engine's plan runs a
    call's steps eagerly, so the drop-in hands it to generate (graphcap's eager loop is no
    faster than generate's) with the plan's reason; without one it serves the call."""
    import torch.distributed as dist

    from graphcap.errors import GenerateFallbackWarning
    from graphcap.rollout import accelerate_generate, restore_generate

    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    model = _llama()
    ids, mask = models.prompts(2, torch.device("cpu"))
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        for group in (dist.group.WORLD, None):
            config = RolloutConfig(backend=HostNPUBackend(), process_group=group)
            installed = accelerate_generate(model, config)
            try:
                with pytest.warns(GenerateFallbackWarning) if group else contextlib.nullcontext():
                    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW)
            finally:
                restore_generate(model)
            assert torch.equal(got, expected)
            assert installed.stats.served == (group is None), dict(installed.stats.fallbacks)
            if group is not None:
                (reason,) = installed.stats.fallbacks
                assert "collectives_in_graph=False" in reason
    finally:
        dist.destroy_process_group()
