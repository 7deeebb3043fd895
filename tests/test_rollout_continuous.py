"""Continuous batching: graph == eager continuous loop == each request alone == generate()."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from rollout_models import (
    PAD,
    assert_rows_equal_alone,
    generate_padded,
    make_engine,
    prompts,
    tiny_model,
)

from graphcap.cpu import CPUBackend
from graphcap.errors import DecodeStalledError
from graphcap.rollout import (
    CaptureFallbackWarning,
    GraphUnsupportedModelError,
    RolloutConfig,
    SamplingParams,
    load_weights_in_place,
)
from graphcap.rollout.holder.agreement import RankAgreement
from graphcap.rollout.step.slots import SlotTable

NEW = 10
SLOTS = 3
REQUESTS = 12
#: per-request budgets: slots finish at different steps, so they are refilled many times
LIMITS = [3, 7, 10, 2, 9, 5, 10, 4, 8, 6, 1, 7]


def engine_for(model, graph: bool, slots: int = SLOTS, interval: int = 2, **config):
    return make_engine(
        model, graph, continuous_batch_size=slots, eos_check_interval=interval, **config
    )


def continuous(model, ids, mask, graph: bool, limits=LIMITS, eos=(), **config):
    engine = engine_for(model, graph, **config)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=list(eos))
    return engine.generate(ids, mask, params, request_max_new_tokens=limits)


def staggered_eos(model, ids, mask) -> list[int]:
    """Two EOS ids from a probe run, each produced once, mid-response, by a long request: those
    rows stop at EOS part-way, every other row at its own length."""
    probe = continuous(model, ids, mask, graph=False)
    width = ids.shape[1]
    rows = [probe.sequences[r, width : width + n].tolist() for r, n in enumerate(LIMITS)]
    counts: dict[int, int] = {}
    for tokens in rows:
        for token in tokens:
            counts[token] = counts.get(token, 0) + 1
    picked = []
    for tokens in rows:
        once = [t for t in tokens[2:-1] if counts[t] == 1]
        if once and len(picked) < 2:
            picked.append(once[0])
    assert len(picked) == 2, "probe outputs too repetitive to stagger EOS"
    return sorted(picked)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_staggered_queue_graph_equals_eager_equals_alone_and_generate(family):
    model = tiny_model(family)
    ids, mask = prompts(REQUESTS, seed=7)
    width = ids.shape[1]
    eos = staggered_eos(model, ids, mask)
    graph = continuous(model, ids, mask, graph=True, eos=eos)
    eager = continuous(model, ids, mask, graph=False, eos=eos)
    assert graph.stats.path == "continuous_graph" and eager.stats.path == "continuous_eager"
    # one graph per batch size reached (the slots, then the ladder's sizes once the queue is
    # empty), every step a replay; the eager loop steps at the same sizes
    assert graph.stats.captures == len(graph.stats.batch_steps)
    assert graph.stats.replays == graph.stats.steps
    assert graph.stats.batch_steps == eager.stats.batch_steps
    assert torch.equal(graph.sequences, eager.sequences)
    assert torch.equal(graph.response_mask, eager.response_mask)
    assert graph.stats.slots_refilled == REQUESTS - SLOTS
    useful = (graph.response_lengths - 1).sum().item()  # decode steps that produced a token
    assert graph.stats.occupancy == pytest.approx(useful / graph.stats.row_steps)
    assert 0 < graph.stats.occupancy <= 1.0
    assert graph.stats.occupancy == eager.stats.occupancy

    lengths = graph.response_lengths.tolist()
    assert len(set(lengths)) >= 5  # staggered finishes
    assert "eos" in graph.finish_reasons and "length" in graph.finish_reasons
    for row, limit in enumerate(LIMITS):
        tokens = graph.sequences[row, width : width + lengths[row]].tolist()
        if limit >= 5 and graph.finish_reasons[row] == "length":
            assert len(set(tokens)) >= 3, f"row {row} repeats: {tokens}"
        assert (graph.sequences[row, width + lengths[row] :] == PAD).all()
        reference = generate_padded(
            model,
            ids[row : row + 1],
            mask[row : row + 1],
            width + limit,
            max_new_tokens=limit,
            do_sample=False,
            eos_token_id=eos or None,
        )
        assert torch.equal(graph.sequences[row, : width + limit], reference[0]), row
    assert_rows_equal_alone(model, ids, mask, graph, LIMITS, lambda row: {"eos_token_id": eos})


def test_retired_slots_are_cleared_and_idle_rows_stay_in_bounds():
    model = tiny_model("gpt2")  # learned positions: an idle row's position must not run away
    ids, mask = prompts(REQUESTS, seed=2)
    # the static cache's sink column (tests/test_kv_blocks.py has the block table's sink block)
    engine = engine_for(model, graph=True, interval=3, kv_block_size=None)
    result = engine.generate(
        ids,
        mask,
        SamplingParams(max_new_tokens=NEW, eos_token_id=[]),
        request_max_new_tokens=LIMITS,
    )
    assert result.stats.path == "continuous_graph"
    assert result.response_lengths.tolist() == LIMITS
    step = engine.step
    # every slot was retired at the end; nothing but the sink column may hold data
    for layer in step.cache.layers:
        assert not layer.keys[:, :, :-1].any() and not layer.values[:, :, :-1].any()
    assert not step.masks.valid[:, :-1].any()
    assert (step.state.positions == 0).all()


def test_reuse_across_prompt_sets_widths_and_weight_updates_and_recapture_on_capacity():
    model = tiny_model("llama", fresh=True)
    engine = engine_for(model, graph=True, batch_ladder=None)  # one graph per slot count
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
    ids, mask = prompts(7, seed=1)
    ids2, mask2 = prompts(9, seed=4)
    limits2 = [NEW, 4, 6, 2, 9, 3, 5, 8, 7]
    first = engine.generate(ids, mask, params)
    second = engine.generate(ids2, mask2, params, request_max_new_tokens=limits2)
    assert first.stats.captured and not second.stats.captured
    assert second.stats.captures == 1 and second.stats.path == "continuous_graph"
    eager2 = continuous(model, ids2, mask2, graph=False, limits=limits2)
    assert torch.equal(second.sequences, eager2.sequences)

    weights = {n: p.detach() * 1.3 + 0.05 for n, p in model.named_parameters() if "mlp" in n}
    load_weights_in_place(model, weights, strict=False)
    updated = engine.generate(ids, mask, params)
    assert updated.stats.captures == 1 and not updated.stats.captured
    assert not torch.equal(updated.sequences, first.sequences)
    assert torch.equal(
        updated.sequences, continuous(model, ids, mask, False, limits=None).sequences
    )

    bigger = engine_for(model, graph=True, slots=SLOTS + 1)
    bigger.generate(ids, mask, params)
    engine.config.continuous_batch_size = SLOTS + 1
    recaptured = engine.generate(ids, mask, params)
    assert recaptured.stats.captured and recaptured.stats.captures == 2
    assert recaptured.stats.recapture_reason == ["batch_size"]
    assert torch.equal(recaptured.sequences, updated.sequences)

    wide, wide_mask = prompts(5, width=8, seed=3)
    # another prompt width in the same length bucket replays the graph (nothing in the step
    # reads the width as a host value)
    narrower = SamplingParams(max_new_tokens=NEW - 2, eos_token_id=[])
    rewidth = engine.generate(wide, wide_mask, narrower)
    assert rewidth.stats.captures == 2 and not rewidth.stats.captured
    assert torch.equal(
        rewidth.sequences,
        engine_for(model, graph=False).generate(wide, wide_mask, narrower).sequences,
    )


@pytest.mark.parametrize("option", ["align_decode_fronts", "trim_cache"])
def test_graph_path_rejects_layout_modes_by_name(option):
    with pytest.raises(ValueError, match=option):
        RolloutConfig(enable_graph_capture=True, continuous_batch_size=2, **{option: True})
    with pytest.raises(ValueError, match="continuous_batch_size"):
        RolloutConfig(**{option: True})


@pytest.mark.parametrize(
    "modes",
    [
        {"align_decode_fronts": True},
        {"trim_cache": True},
        {"align_decode_fronts": True, "trim_cache": True},
    ],
    ids=["align", "trim", "align+trim"],
)
def test_eager_layout_modes_match_plain_eager(modes):
    model = tiny_model("qwen2")
    ids, mask = prompts(REQUESTS, seed=9)
    # two more left-pad columns on every row: dead columns that trimming can drop
    ids = torch.cat([torch.full((REQUESTS, 2), PAD), ids], dim=1)
    mask = torch.cat([torch.zeros((REQUESTS, 2), dtype=mask.dtype), mask], dim=1)
    eos = staggered_eos(model, ids, mask)
    plain = continuous(model, ids, mask, graph=False, eos=eos)
    engine = engine_for(model, graph=False, **modes)
    moved = engine.generate(
        ids,
        mask,
        SamplingParams(max_new_tokens=NEW, eos_token_id=eos),
        request_max_new_tokens=LIMITS,
    )
    assert moved.stats.path == "continuous_eager"
    assert moved.stats.moved_columns > 0  # the layout really moved
    assert moved.stats.mean_span < moved.stats.total_len  # and attention read fewer columns
    if "trim_cache" in modes:
        assert moved.stats.mean_span < plain.stats.total_len
    assert torch.equal(moved.sequences, plain.sequences)
    assert torch.equal(moved.response_mask, plain.response_mask)
    assert moved.finish_reasons == plain.finish_reasons


def test_eager_layouts_read_each_samples_prompt_padding():
    """With ``num_return_sequences`` each request is a sample of a prompt: the layouts' span
    and trim read that prompt's left padding (prompts padded differently; one slot, so each
    request is trimmed to its own first real token)."""
    model = tiny_model("qwen2")
    ids, mask = prompts(4, seed=9)
    ids = torch.cat([torch.full((4, 2), PAD), ids], dim=1)  # every prompt has dead columns
    mask = torch.cat([torch.zeros((4, 2), dtype=mask.dtype), mask], dim=1)
    params = SamplingParams(
        max_new_tokens=NEW, eos_token_id=[], num_return_sequences=2, do_sample=True, seed=3
    )
    limits = [4, 9, 2, 7]
    runs = [
        engine_for(model, graph=False, slots=1, **modes).generate(
            ids, mask, params, request_max_new_tokens=limits
        )
        for modes in ({}, {"trim_cache": True})
    ]
    assert runs[1].stats.moved_columns > 0
    assert torch.equal(runs[1].sequences, runs[0].sequences)


@pytest.mark.parametrize(
    "settings",
    [
        {"seed": None, "top_k": 20},  # the shared generator, as generate draws
        {"seed": 3, "top_p": 0.8, "num_return_sequences": 2},  # per-row streams, n samples
    ],
    ids=["shared-generator", "seeded-rows-n2"],
)
def test_sampling_on_the_continuous_graph_equals_its_eager_loop(settings):
    model = tiny_model("llama")
    ids, mask = prompts(5, seed=5)
    params = SamplingParams(do_sample=True, max_new_tokens=6, eos_token_id=[], **settings)
    outs = {}
    for graph in (True, False):
        engine = engine_for(model, graph=graph)
        torch.manual_seed(11)  # only the shared-generator case draws from it
        outs[graph] = engine.generate(ids, mask, params, request_max_new_tokens=[6, 3, 5, 6, 2])
    assert outs[True].stats.path == "continuous_graph", outs[True].stats.fallback_reason
    assert outs[True].stats.captures == len(outs[True].stats.batch_steps)  # one a size reached
    assert torch.equal(outs[True].sequences, outs[False].sequences)
    assert torch.equal(outs[True].response_mask, outs[False].response_mask)
    repeats = settings.get("num_return_sequences", 1)
    assert outs[True].sequences.shape[0] == 5 * repeats
    if repeats > 1:  # a prompt's samples share its prompt and differ in what they draw
        first, second = outs[True].sequences[0::2], outs[True].sequences[1::2]
        assert torch.equal(first[:, : ids.shape[1]], second[:, : ids.shape[1]])
        assert not torch.equal(first, second)


def test_graph_unsafe_attention_and_bad_input_are_refused():
    model = tiny_model("llama", fresh=True)
    # private: set_attn_implementation refuses flash_attention_2 without flash-attn installed
    model.config._attn_implementation = "flash_attention_2"
    ids, mask = prompts(4)
    with pytest.raises(GraphUnsupportedModelError, match="flash_attention_2"):
        engine_for(model, graph=True).generate(ids, mask, SamplingParams(max_new_tokens=3))
    plain = make_engine(tiny_model("llama"), False)
    with pytest.raises(ValueError, match="continuous_batch_size"):
        plain.generate(ids, mask, request_max_new_tokens=[2, 2, 2, 2])
    engine = engine_for(tiny_model("llama"), graph=False)
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=3), request_max_new_tokens=[2])
    with pytest.raises(ValueError, match="max_new_tokens=3"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=3), request_max_new_tokens=[4] * 4)
    with pytest.raises(ValueError, match="continuous_batch_size must be"):
        RolloutConfig(continuous_batch_size=0)


def benchmark_script():
    path = Path(__file__).parents[1] / "benchmarks" / "continuous.py"
    spec = importlib.util.spec_from_file_location("continuous_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_benchmark_script_tiny_workloads_agree():
    bench = benchmark_script()
    backend = CPUBackend()
    model = bench.build_model("tiny-gpt2", backend)
    shape = {**bench.TINY, "repeats": 1, "staggered_repeats": 1, "intervals": (3,)}
    with torch.no_grad():
        latency = bench.latency(model, backend, shape)
        staggered = bench.staggered(model, backend, shape)
    assert latency["continuous_graph"]["captured_on_first_call"]
    assert all(run["token_equal_to_eager"] for run in latency.values())
    runs = staggered["eos_check_interval=3"]
    assert runs["continuous_graph"]["path"] == "continuous_graph"
    assert runs["continuous_graph"]["token_equal_to_eager"]
    assert runs["continuous_graph"]["tokens"] == sum(staggered["budgets"])
    for name in ("static_graph_one_batch", "static_graph_slot_batches"):
        static = staggered[name]
        assert static["path"] == "static_graph" and static["captured_on_first_call"]
        # fp32 on CPU: the static path's budgeted tokens are the continuous path's
        assert static["requests_equal_to_continuous"] == shape["requests"]


def test_benchmark_script_block_table_workload():
    """Static cache against block table, graph tokens against eager ones; an engine without
    ``RolloutConfig.kv_block_size`` gets the workload reported unavailable."""
    bench = benchmark_script()
    backend = CPUBackend()
    model = bench.build_model("tiny-gpt2", backend)
    shape = {**bench.TINY, "block_repeats": 1, "block_slots": (4,)}
    with torch.no_grad():
        out = bench.block_table(model, backend, shape, 4)
    if "kv_block_size" not in RolloutConfig.__dataclass_fields__:
        assert out == {"skipped": bench.NO_BLOCKS}
        return
    runs = out["slots=4"]
    for run in runs.values():
        assert run["path"] == "continuous_graph" and run["token_equal_to_eager"]
        assert run["tokens"] == sum(out["budgets"]) and run["cache_bytes"] > 0
    assert runs["block_table"]["token_equal_to_static_graph"]  # fp32 on CPU
    assert runs["static_cache"]["kv_layout"] == "static"
    blocks = runs["block_table"]
    assert blocks["kv_layout"] == "blocks" and blocks["kv_blocks_held"] > 0
    assert blocks["kv_pool_growths"] >= 0


def test_capture_failure_finishes_eagerly_with_equal_tokens():
    model = tiny_model("llama", fresh=True)
    backend = CPUBackend()

    def host_read_during_capture(module, args, output):
        if backend.is_current_stream_capturing():
            output[0].sum().item()  # a host sync: the CPU graph refuses it mid-capture

    handle = model.model.layers[0].register_forward_hook(host_read_during_capture)
    engine = make_engine(model, backend=backend, continuous_batch_size=SLOTS)
    ids, mask = prompts(REQUESTS, seed=7)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
    with pytest.warns(CaptureFallbackWarning, match="capture failed"):
        failed = engine.generate(ids, mask, params, request_max_new_tokens=LIMITS)
    handle.remove()
    assert failed.stats.path == "continuous_eager" and not failed.stats.captured
    assert "capture failed" in failed.stats.fallback_reason
    assert torch.equal(failed.sequences, continuous(model, ids, mask, graph=False).sequences)


@pytest.fixture
def finished_reads(monkeypatch):
    """Counts the host reads of the slots' ``finished`` flags (the refill check's one read)."""
    reads = []
    original = RankAgreement.finished_rows

    def counted(self, finished):
        reads.append(finished.shape[0])
        return original(self, finished)

    monkeypatch.setattr(RankAgreement, "finished_rows", counted)
    return reads


#: (slots, budgets, steps, occupancy) worked out by hand. Longest budget first; a request of
#: budget b holds its slot for b - 1 decode steps (its first token comes from the prefill) and
#: its slot is refilled right after its last one. 3 slots, LIMITS: the 9, 9, 8 step requests
#: start; 7 at step 8, 6 and 6 at 9 (all end at 15); then 5, 4, 3 (end 20, 19, 18); 2 at 18 and
#: 1 at 19 end at 20, where the budget-1 request comes and goes: 60 of 3 x 20 slot-steps.
#: 2 slots, budgets 2, 6, 3, 1: 6 and 3 start; 2 at step 2 (ends 3), then budget 1; 6 ends at 5.
#: Without the live-row ladder (tests/test_rollout_continuous_ladder.py has its schedules).
KNOWN = [(SLOTS, LIMITS, 20, 1.0), (2, [2, 6, 3, 1], 5, 0.8)]


@pytest.mark.parametrize(("slots", "limits", "steps", "occupancy"), KNOWN)
@pytest.mark.parametrize("interval", [1, 3, 100])
def test_budget_finishes_refill_at_their_step_whatever_the_check_interval(
    slots, limits, steps, occupancy, interval, finished_reads
):
    model = tiny_model("llama")
    ids, mask = prompts(len(limits), seed=4)
    outs = {}
    for graph in (True, False):
        finished_reads.clear()
        outs[graph] = continuous(
            model,
            ids,
            mask,
            graph,
            limits=limits,
            slots=slots,
            interval=interval,
            batch_ladder=None,
        )
        result = outs[graph]
        assert result.stats.steps == steps
        assert result.stats.occupancy == occupancy
        assert result.stats.slots_refilled == len(limits) - slots
        assert result.response_lengths.tolist() == limits  # request order
        # budget refills need no device read: one read per check interval, no more
        assert len(finished_reads) == steps // interval
    assert outs[True].stats.path == "continuous_graph", outs[True].stats.fallback_reason
    assert torch.equal(outs[True].sequences, outs[False].sequences)
    assert torch.equal(outs[True].response_mask, outs[False].response_mask)


def test_eos_and_stop_token_rows_retire_at_the_check_graph_equals_eager_equals_alone(
    finished_reads,
):
    model = tiny_model("llama")
    ids, mask = prompts(REQUESTS, seed=7)
    eos, stop = staggered_eos(model, ids, mask)
    interval = 3
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[eos], stop_token_ids=[stop])
    outs = {}
    for graph in (True, False):
        finished_reads.clear()
        engine = engine_for(model, graph, interval=interval)
        outs[graph] = engine.generate(ids, mask, params, request_max_new_tokens=LIMITS)
        assert len(finished_reads) == outs[graph].stats.steps // interval
    graph, eager = outs[True], outs[False]
    assert graph.stats.path == "continuous_graph", graph.stats.fallback_reason
    assert torch.equal(graph.sequences, eager.sequences)
    assert torch.equal(graph.response_mask, eager.response_mask)
    assert graph.stats.steps == eager.stats.steps
    assert {"eos", "stop", "length"} <= set(graph.finish_reasons)
    stops = {"eos_token_id": [eos], "stop_token_ids": [stop]}
    assert_rows_equal_alone(model, ids, mask, graph, LIMITS, lambda row: stops)


def test_benchmark_staggered_workload_reaches_target_occupancy():
    """The H200 benchmark's 64 requests (budgets 8..64) through 16 slots: occupancy is a step
    count, so a tiny model and short prompts give the accelerator's figure exactly (without EOS
    it does not depend on the check interval: the test above)."""
    bench = benchmark_script()
    shape = bench.FULL
    model = tiny_model("llama", max_position_embeddings=128)
    ids, budgets = bench.workload(shape, model.config.vocab_size)
    ids = ids[:, :4]
    engine = engine_for(model, graph=True, slots=shape["slots"], interval=shape["intervals"][0])
    params = SamplingParams(max_new_tokens=shape["budget"][1], eos_token_id=[])
    result = engine.generate(ids, torch.ones_like(ids), params, request_max_new_tokens=budgets)
    useful = sum(budgets) - len(budgets)
    assert result.stats.steps == 143  # before: 208 at interval 16, 176 at interval 4
    # once the queue is empty the last requests move down the ladder: 2250 slot-steps run, where
    # 16 x 143 = 2288 ran without it (occupancy 0.983)
    assert result.stats.row_steps == 2250
    assert result.stats.occupancy == useful / 2250 >= 0.9


class _ReplaysNothing(CPUBackend):
    """The CPU reference backend whose graph replays do nothing (a broken backend)."""

    name = "replays-nothing"

    def replay_graph(self, graph) -> None:
        pass


def test_a_decode_that_finishes_nothing_stops_with_the_backend_named(monkeypatch):
    """Where neither the device's finished flags nor the host's budgets retire a row (replays
    that change nothing, and host bookkeeping out of step), the call stops after the most steps
    its requests can take, with an error naming the backend and what to run, instead of
    looping forever."""
    monkeypatch.setattr(SlotTable, "due_by", lambda self, step: [])
    model = tiny_model("llama")
    ids, mask = prompts(4)
    engine = make_engine(
        model, True, continuous_batch_size=2, eos_check_interval=2, backend=_ReplaysNothing()
    )
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(DecodeStalledError, match=r"'replays-nothing'.*conformance suite"):
        engine.generate(ids, mask, params, request_max_new_tokens=[4, 3, 2, 4])
