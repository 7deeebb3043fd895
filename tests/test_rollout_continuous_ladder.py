"""The continuous path on the live-row ladder: once no request waits for a slot, the busy slots
move to the leading slots and the steps run at the smallest ladder size that holds them, and no
request's tokens change (fp32, CPU reference graphs).

Every check compares a call on the ladder with the same call without it (``batch_ladder=None``)
and with the eager loop (which follows the same ladder), on queues longer than the slots (so
slots are refilled before the queue empties) whose requests end at many different steps (a set
of EOS ids, per-request budgets), on the static cache and on the block table.
"""

from __future__ import annotations

import pytest
import torch
from rollout_models import assert_same_rows, generate_padded, make_engine, prompts, tiny_model

from graphcap.rollout import SamplingParams

pytestmark = pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")

NEW = 12
#: ids that end rows: with the tiny models' random weights, rows end at many different steps
STOPS = [3, 5, 9, 17, 33, 40, 60, 77, 90, 101]


def engine(model, slots: int, ladder="auto", graph=True, interval=2, **config):
    return make_engine(
        model,
        graph,
        continuous_batch_size=slots,
        batch_ladder=ladder,
        eos_check_interval=interval,
        **config,
    )


def three_ways(model, ids, mask, params, slots, limits=None, **config):
    """The call on the ladder, without it, and on the eager loop (on the ladder)."""
    results = []
    for ladder, graph in (("auto", True), (None, True), ("auto", False)):
        torch.manual_seed(0)  # what unseeded rows' keys are drawn from
        e = engine(model, slots, ladder, graph, **config)
        results.append(e.generate(ids, mask, params, request_max_new_tokens=limits))
    return results


def assert_shrank(ladder, plain, eager, slots: int) -> None:
    assert ladder.stats.path == plain.stats.path == "continuous_graph"
    assert len(ladder.stats.batch_steps) > 1, ladder.stats.batch_steps  # it shrank
    assert ladder.stats.rows_moved > 0
    assert ladder.stats.row_steps < slots * ladder.stats.steps
    assert ladder.stats.slots_refilled > 0  # refills came before the queue emptied
    assert plain.stats.batch_steps == {} and plain.stats.rows_moved == 0
    # the eager loop steps at the same sizes, on the same schedule
    assert eager.stats.batch_steps == ladder.stats.batch_steps
    assert eager.stats.steps == ladder.stats.steps
    assert ladder.stats.occupancy > plain.stats.occupancy


@pytest.mark.parametrize("kv_block_size", [None, "auto"], ids=["static-cache", "block-table"])
@pytest.mark.parametrize(
    ("family", "requests", "slots", "interval"),
    [("llama", 12, 6, 2), ("gpt2", 9, 4, 3), ("qwen2", 20, 12, 1)],
)
def test_greedy_requests_on_the_ladder_equal_generate(
    family, requests, slots, interval, kv_block_size
):
    model = tiny_model(family)
    ids, mask = prompts(requests, seed=requests)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS)
    ladder, plain, eager = three_ways(
        model, ids, mask, params, slots, interval=interval, kv_block_size=kv_block_size
    )
    assert_shrank(ladder, plain, eager, slots)
    assert_same_rows(ladder, plain)
    assert_same_rows(ladder, eager)
    total = ids.shape[1] + NEW
    reference = generate_padded(model, ids, mask, total, max_new_tokens=NEW, eos_token_id=STOPS)
    assert torch.equal(ladder.sequences, reference)


#: per-request budgets: with the EOS ids, requests end at every step, several at once
LIMITS = [12, 5, 9, 12, 3, 7, 12, 2, 10, 6, 12, 4, 8, 11]


@pytest.mark.parametrize(
    "sampling",
    [
        {"do_sample": True},
        {"do_sample": True, "seed": 4, "top_k": 9, "temperature": 0.8},
        {"do_sample": True, "repetition_penalty": 1.3, "frequency_penalty": 0.4},
        {"stop_sequences": [[7, 8], [20]], "min_new_tokens": 2, "presence_penalty": 0.5},
        {"do_sample": True, "seed": 2, "num_return_sequences": 2, "return_logprobs": True},
    ],
    ids=["keyed-by-the-call", "seeded-top-k", "penalties", "stop-sequences", "n2-logprobs"],
)
def test_requests_draw_the_same_tokens_wherever_they_run(sampling):
    model = tiny_model("llama")
    repeats = sampling.get("num_return_sequences", 1)
    count = len(LIMITS) // repeats
    ids, mask = prompts(count, seed=3)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS, **sampling)
    ladder, plain, eager = three_ways(
        model, ids, mask, params, slots=5, limits=LIMITS[:count], interval=3
    )
    assert_shrank(ladder, plain, eager, slots=5)
    assert_same_rows(ladder, plain)
    assert_same_rows(ladder, eager)
    if "stop_sequences" in sampling:
        assert any(ladder.stop_sequences), "no request ended at a stop sequence"


def test_requests_that_end_together_and_at_a_move_block_table_and_static_cache():
    """Interval 1: the flags are read after every step, so a move can follow every step, with
    requests ending on the step before a move and on it; the same call on both layouts."""
    model = tiny_model("mistral")
    ids, mask = prompts(16, seed=5)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS, do_sample=True, seed=9)
    limits = [NEW, 4, 4, NEW, 7, 7, 7, 2, NEW, 9, 9, 5, 5, 5, NEW, 3]
    outs = {}
    for layout in (None, "auto"):
        ladder, plain, eager = three_ways(
            model, ids, mask, params, 8, limits, interval=1, kv_block_size=layout
        )
        assert_shrank(ladder, plain, eager, slots=8)
        assert_same_rows(ladder, plain)
        assert_same_rows(ladder, eager)
        outs[layout] = ladder
    assert_same_rows(outs[None], outs["auto"])
    assert outs[None].stats.batch_steps == outs["auto"].stats.batch_steps


def test_each_size_is_captured_once_and_kept_across_calls():
    model = tiny_model("llama")
    ids, mask = prompts(10, seed=3)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS)
    e = engine(model, 6, kv_block_size=None)  # a static cache: no pool growth recaptures
    first = e.generate(ids, mask, params)
    sizes = set(first.stats.batch_steps)
    assert len(sizes) > 1 and first.stats.captures == len(sizes)  # one graph a size reached
    # the slots rows moved out of were cleared as retired ones are: at the end nothing but the
    # sink column holds K/V, and no mask column is open
    assert first.stats.rows_moved > 0
    for layer in e.step.cache.layers:
        assert not layer.keys[:, :, :-1].any() and not layer.values[:, :, :-1].any()
    assert not e.step.masks.valid[:, :-1].any()
    again = e.generate(ids, mask, params)
    assert again.stats.captures == first.stats.captures and not again.stats.captured
    assert again.stats.batch_steps == first.stats.batch_steps
    assert_same_rows(first, again)
    # other requests: only a size no call reached yet is captured
    for seed in (1, 2):
        other_ids, other_mask = prompts(10, seed=seed)
        out = e.generate(other_ids, other_mask, params)
        sizes |= set(out.stats.batch_steps)
        assert out.stats.captures == len(sizes)


#: (slots, budgets, steps, steps at each size, rows moved, plain occupancy) worked out by hand.
#: A request of budget b holds its slot for b - 1 decode steps (its first token comes from the
#: prefill); longest budget first. 2 slots, budgets 2, 6, 3, 1: 6 and 3 start; 2 at step 2
#: (ends 3), then budget 1 comes and goes; the queue is empty with one request left, so steps
#: 4 and 5 run at size 1. 3 slots, budgets 10, 6, 5, 5: 10, 6, 5 start; the other 5 takes the
#: third slot after step 4 (ends 8) and the queue is empty; 6 ends at step 5, so the third
#: slot's request moves to the second and steps 6-8 run at size 2; after step 8, 10 is left
#: alone at size 1 for step 9. Every slot-step run produces a token (occupancy 1).
KNOWN = [
    (2, [2, 6, 3, 1], 5, {2: 3, 1: 2}, 0, 0.8),
    (3, [10, 6, 5, 5], 9, {3: 5, 2: 3, 1: 1}, 1, 22 / 27),
]


@pytest.mark.parametrize(("slots", "limits", "steps", "sizes", "moved", "plain_occupancy"), KNOWN)
def test_budget_finishes_move_down_the_ladder(slots, limits, steps, sizes, moved, plain_occupancy):
    model = tiny_model("llama")
    ids, mask = prompts(len(limits), seed=4)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
    ladder, plain, eager = three_ways(model, ids, mask, params, slots, limits, interval=100)
    for result in (ladder, eager):
        assert result.stats.steps == plain.stats.steps == steps
        assert result.stats.batch_steps == sizes and result.stats.rows_moved == moved
        assert result.stats.row_steps == sum(limits) - len(limits)
        assert result.stats.occupancy == 1.0
    assert plain.stats.occupancy == plain_occupancy
    assert_same_rows(ladder, plain)
    assert_same_rows(ladder, eager)
    assert ladder.response_lengths.tolist() == limits


def test_where_the_continuous_path_keeps_its_slots():
    model = tiny_model("llama")
    ids, mask = prompts(8, seed=1)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS, do_sample=True)
    # generate's own random numbers: one multinomial over every slot, so no row may move
    out = engine(model, 4, draws="generate").generate(ids, mask, params)
    assert out.stats.path == "continuous_graph" and out.stats.batch_steps == {}
    # the eager layout modes move cache columns under the span the step attends over
    greedy = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS)
    for mode in ("align_decode_fronts", "trim_cache"):
        out = engine(model, 4, graph=False, **{mode: True}).generate(ids, mask, greedy)
        assert out.stats.batch_steps == {} and out.stats.row_steps == 0
    # an explicit ladder: only its sizes
    out = engine(model, 4, ladder=(3,)).generate(ids, mask, greedy)
    assert set(out.stats.batch_steps) <= {4, 3}
