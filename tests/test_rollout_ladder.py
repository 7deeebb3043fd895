"""The live-row ladder: a static graph call shrinks to smaller batch sizes as rows end, and no
row's tokens change (fp32, CPU reference graphs).

Every check compares a call on the ladder with the same call without it (``batch_ladder=None``)
and with the eager loop, on calls whose rows end at many different steps (a set of EOS ids),
so rows move at several sizes, on the static cache and on the block table.
"""

from __future__ import annotations

import time

import pytest
import torch
from rollout_models import assert_same_rows, generate_padded, prompts, tiny_model

from graphcap.cpu import CPUBackend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

pytestmark = pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")

NEW = 20
#: ids that end rows: with the tiny models' random weights, rows end at many different steps
STOPS = [3, 5, 9, 17, 33, 40, 60, 77, 90, 101]


def engine(model, ladder="auto", graph=True, **config) -> RolloutEngine:
    config = RolloutConfig(
        enable_graph_capture=graph, backend=CPUBackend(), batch_ladder=ladder, **config
    )
    return RolloutEngine(model, config)


def three_ways(model, ids, mask, params, **config):
    """The call on the ladder, without it, and eagerly."""
    results = []
    for ladder, graph in (("auto", True), (None, True), (None, False)):
        torch.manual_seed(0)
        results.append(engine(model, ladder, graph, **config).generate(ids, mask, params))
    return results


@pytest.mark.parametrize("kv_block_size", [None, "auto"], ids=["static-cache", "block-table"])
@pytest.mark.parametrize(("family", "batch"), [("llama", 8), ("gpt2", 5), ("qwen2", 12)])
def test_greedy_rows_on_the_ladder_equal_generate(family, batch, kv_block_size):
    model = tiny_model(family)
    ids, mask = prompts(batch, seed=batch)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS)
    ladder, plain, eager = three_ways(
        model, ids, mask, params, eos_check_interval=2, kv_block_size=kv_block_size
    )
    assert ladder.stats.path == plain.stats.path == "static_graph"
    assert len(ladder.stats.batch_steps) > 1, ladder.stats.batch_steps  # it shrank
    assert ladder.stats.rows_moved > 0
    assert ladder.stats.row_steps < batch * ladder.stats.steps
    assert_same_rows(ladder, plain)
    assert_same_rows(ladder, eager)
    total = ids.shape[1] + NEW
    reference = generate_padded(model, ids, mask, total, max_new_tokens=NEW, eos_token_id=STOPS)
    assert torch.equal(ladder.sequences, reference)


@pytest.mark.parametrize(
    "sampling",
    [
        {"do_sample": True},
        {"do_sample": True, "seed": 4, "top_k": 9, "temperature": 0.8},
        {"do_sample": True, "top_p": 0.7, "repetition_penalty": 1.3, "min_new_tokens": 4},
        {"stop_sequences": [[7, 8], [20]], "presence_penalty": 0.5},
        {"do_sample": True, "return_logprobs": True, "top_logprobs": 3},
    ],
    ids=["unseeded", "seeded-top-k", "top-p-penalty-min-new", "stop-sequences", "logprobs"],
)
def test_rows_draw_the_same_tokens_wherever_they_run(sampling):
    model = tiny_model("llama")
    ids, mask = prompts(9, seed=2)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS, **sampling)
    ladder, plain, eager = three_ways(model, ids, mask, params, eos_check_interval=3)
    assert len(ladder.stats.batch_steps) > 1
    assert_same_rows(ladder, plain)
    assert_same_rows(ladder, eager)
    if params.top_logprobs:
        torch.testing.assert_close(ladder.top_logprobs, plain.top_logprobs, rtol=0, atol=1e-5)
        assert torch.equal(ladder.top_logprob_ids, plain.top_logprob_ids)


def test_rows_that_end_together_and_rows_that_end_at_a_move():
    """Interval 1: a move at every step, rows ending on the step before a move and on it."""
    model = tiny_model("mistral")
    ids, mask = prompts(16, seed=5)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS)
    ladder, plain, _ = three_ways(model, ids, mask, params, eos_check_interval=1)
    assert_same_rows(ladder, plain)
    assert len(ladder.stats.batch_steps) > 1


def test_each_size_is_captured_once_and_kept_across_calls():
    model = tiny_model("llama")
    ids, mask = prompts(8, seed=1)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS)
    e = engine(model, eos_check_interval=2)
    first = e.generate(ids, mask, params)
    sizes = set(first.stats.batch_steps)
    assert first.stats.captures == len(sizes)  # the full size and each smaller one reached
    again = e.generate(ids, mask, params)
    assert again.stats.captures == first.stats.captures and not again.stats.captured
    assert_same_rows(first, again)
    # other prompts of the same shape: only a size no call reached yet is captured
    for seed in (2, 3, 4):
        other_ids, other_mask = prompts(8, seed=seed)
        out = e.generate(other_ids, other_mask, params)
        sizes |= set(out.stats.batch_steps)
        assert out.stats.captures == len(sizes)


@pytest.mark.parametrize("slots", [None, 4], ids=["static", "continuous"])
def test_captures_taken_mid_decode_count_once_in_the_calls_seconds(slots):
    """A first call captures its smaller sizes inside the decode loop: they are in
    ``capture_s``, not also in ``decode_s`` (its parts are disjoint spans of the call)."""
    model = tiny_model("llama")
    ids, mask = prompts(8, seed=1)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS)
    e = engine(model, eos_check_interval=2, continuous_batch_size=slots)
    start = time.perf_counter()
    stats = e.generate(ids, mask, params).stats
    call_s = time.perf_counter() - start
    assert len(stats.batch_steps) > 1 and stats.captures > 1  # sizes captured mid-decode
    assert stats.prefill_s + stats.capture_s + stats.decode_s <= call_s


def test_bucket_padding_rows_are_left_at_the_first_check():
    model = tiny_model("llama")
    ids, mask = prompts(3, seed=6)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
    out = engine(model, batch_buckets=(8,), eos_check_interval=2).generate(ids, mask, params)
    assert out.stats.batch_size == 8
    assert out.stats.batch_steps == {8: 2, 3: NEW - 3}  # three live rows: size 3 of the ladder


def test_an_explicit_ladder_and_the_cases_that_do_not_shrink():
    model = tiny_model("llama")
    ids, mask = prompts(8, seed=1)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS)
    out = engine(model, ladder=(6, 3), eos_check_interval=2).generate(ids, mask, params)
    assert set(out.stats.batch_steps) <= {8, 6, 3}
    # generate's own random numbers: one multinomial over every row, so no row may leave
    sampled = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS, do_sample=True)
    out = engine(model, draws="generate", eos_check_interval=2).generate(ids, mask, sampled)
    assert out.stats.batch_steps == {}
    # every row's scores at every step (generate's output_scores): ended rows' too
    scored = SamplingParams(max_new_tokens=NEW, eos_token_id=STOPS, output_scores=True)
    assert engine(model, eos_check_interval=2).generate(ids, mask, scored).stats.batch_steps == {}
    with pytest.raises(ValueError, match="batch_ladder"):
        RolloutConfig(batch_ladder=(0, 4))


@pytest.mark.parametrize("slots", [None, 4], ids=["static", "continuous"])
@pytest.mark.parametrize("kv_block_size", [None, "auto"], ids=["static-cache", "block-table"])
def test_rounds_of_new_prompt_widths_capture_each_size_once(slots, kv_block_size):
    """An RL trainer's rounds: prompts padded to a new width every round, rows ending at EOS
    ids. In the default configuration (length buckets, ladder) the engine captures each batch
    size's graph once, whatever the width, on both paths and both K/V layouts."""
    backend, captures = CPUBackend(), []
    capture = backend.capture_to_graph
    backend.capture_to_graph = lambda *a, **k: captures.append(1) or capture(*a, **k)
    config = RolloutConfig(
        enable_graph_capture=True,
        backend=backend,
        continuous_batch_size=slots,
        kv_block_size=kv_block_size,
    )
    e = RolloutEngine(tiny_model("llama"), config)
    params = SamplingParams(
        max_new_tokens=19,  # widths 6-13 + 19: one length bucket (32 columns)
        do_sample=True,
        num_return_sequences=2,
        eos_token_id=STOPS,
    )
    reached: set[int] = set()
    for width in range(6, 14):
        result = e.generate(*prompts(4, width, seed=width), params)
        assert result.stats.path.endswith("graph"), result.stats.fallback_reason
        reached |= set(result.stats.batch_steps)
    assert len(reached) > 1 and len(captures) == result.stats.captures == len(reached)
