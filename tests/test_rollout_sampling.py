"""One graph for any sampling setting: per-row settings, log-prob modes, seeds, stop ids, aliases.

Everything runs through ``RolloutEngine`` with graphs on the CPU reference backend. The checks
shared with the device test (``test_device_sampling.py``) take the backend as an argument.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rollout_models import prompts, teacher_forced_logits, tiny_model
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from graphcap.cpu import CPUBackend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

pytestmark = pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")

NEW = 8
NO_EOS = {"eos_token_id": []}

#: one batch, four rows, four settings (two seeded sampled rows, two greedy rows)
MIXED = [
    {"do_sample": True, "temperature": 0.7, "top_k": 5, "seed": 11},
    {"max_new_tokens": NEW},
    {"do_sample": True, "top_p": 0.8, "min_p": 0.05, "temperature": 1.2, "seed": 5},
    {"repetition_penalty": 1.3},
]


def engine_on(model, backend=None, graph: bool = True, **config) -> RolloutEngine:
    config = RolloutConfig(enable_graph_capture=graph, backend=backend or CPUBackend(), **config)
    return RolloutEngine(model, config)


def mixed_params(**common) -> list[SamplingParams]:
    base = {"max_new_tokens": NEW, **NO_EOS, **common}
    return [SamplingParams(**{**base, **row}) for row in MIXED]


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers for ``params`` (no penalty) applied to (N, V) logits."""
    if not params.do_sample:
        return logits
    scores = TemperatureLogitsWarper(params.temperature)(None, logits)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    if params.min_p:
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    return scores


def check_mixed_batch_matches_rows_alone(model, backend) -> None:
    """Mixed settings in one batch replay one capture; each row equals that row run alone."""
    ids, mask = (t.to(backend.device) for t in prompts(4, seed=6))
    engine = engine_on(model, backend)
    params = mixed_params()
    batch = engine.generate(ids, mask, params)
    assert batch.stats.path == "static_graph" and batch.stats.captures == 1
    for row, row_params in enumerate(params):
        alone = engine_on(model, backend).generate(
            ids[row : row + 1], mask[row : row + 1], row_params
        )
        assert torch.equal(batch.sequences[row], alone.sequences[0]), f"row {row}"
    again = engine.generate(ids, mask, params)
    assert again.stats.captures == 1 and torch.equal(again.sequences, batch.sequences)


def check_logprob_modes_match_recomputation(model, backend, atol: float) -> None:
    """Each log-prob mode against a teacher-forced forward over the returned sequences; all
    three modes in one batch, one capture."""
    ids, mask = (t.to(backend.device) for t in prompts(3, seed=2))
    sampled = {"do_sample": True, "temperature": 0.7, "top_k": 8, "top_p": 0.9, "seed": 3}
    modes = ["sampling", "temperature", "raw"]
    params = [
        SamplingParams(
            max_new_tokens=NEW, return_logprobs=True, logprobs_mode=mode, **sampled, **NO_EOS
        )
        for mode in modes
    ]
    engine = engine_on(model, backend)
    result = engine.generate(ids, mask, params)
    assert result.stats.path == "static_graph" and result.stats.captures == 1
    logits = teacher_forced_logits(model, result.sequences, mask, NEW)
    width = ids.shape[1]
    chosen = result.sequences[:, width:]
    expected = {
        "sampling": sampling_distribution(logits[0], params[0]),
        "temperature": logits[1] / params[1].temperature,
        "raw": logits[2],
    }
    for row, mode in enumerate(modes):
        reference = torch.log_softmax(expected[mode], -1).gather(1, chosen[row, :, None])[:, 0]
        torch.testing.assert_close(result.logprobs[row], reference, atol=atol, rtol=0, msg=mode)
    # truncation renormalises: the sampled distribution's log-probs are never below the full one
    full = torch.log_softmax(logits[0] / params[0].temperature, -1).gather(1, chosen[0, :, None])
    assert (result.logprobs[0] >= full[:, 0] - atol).all()
    assert (result.logprobs[0] > full[:, 0] + 1e-3).any()


# ---- one graph ------------------------------------------------------------------------------
def test_sampled_training_and_greedy_evaluation_alternate_on_one_capture():
    model = tiny_model("llama")
    ids, mask = prompts(2, seed=1)
    # n=4 changes the batch: one bucket for both; no ladder, this test counts one graph
    engine = engine_on(model, batch_buckets=(8,), batch_ladder=None)
    train = SamplingParams(
        do_sample=True,
        num_return_sequences=4,
        temperature=0.8,
        return_logprobs=True,
        logprobs_mode="temperature",
        max_new_tokens=NEW,
        seed=7,
        **NO_EOS,
    )
    evaluation = SamplingParams(max_new_tokens=NEW, **NO_EOS)
    reference = engine_on(model).generate(ids, mask, evaluation)  # a greedy-only engine
    results = [engine.generate(ids, mask, p) for p in (train, evaluation) * 3]
    assert [r.stats.captures for r in results] == [1] * 6
    assert all(r.stats.path == "static_graph" for r in results)
    for greedy in results[1::2]:
        assert torch.equal(greedy.sequences, reference.sequences)
        assert greedy.logprobs is None
    first = results[0]
    assert first.sequences.shape[0] == 8 and first.logprobs.shape == (8, NEW)
    assert all(torch.equal(r.sequences, first.sequences) for r in results[::2])  # seeded
    width = ids.shape[1]
    assert len({tuple(r) for r in first.sequences[:4, width:].tolist()}) == 4


def test_greedy_first_then_sampling_captures_each_shape_once_then_never():
    """After a sampled call, greedy calls replay the sampling graph that does not truncate:
    a call pays for its own rows' truncation, never for an earlier call's."""
    model = tiny_model("gpt2")
    ids, mask = prompts(3, seed=4)
    engine = engine_on(model)
    greedy = SamplingParams(max_new_tokens=NEW, **NO_EOS)
    sampled = SamplingParams(do_sample=True, top_p=0.9, max_new_tokens=NEW, seed=1, **NO_EOS)
    calls = (greedy, sampled, greedy, sampled, greedy)
    counts = [engine.generate(ids, mask, p).stats for p in calls]
    assert [s.captures for s in counts] == [1, 2, 3, 3, 3]
    assert counts[1].recapture_reason == ["sampler"]
    assert [s.sampler_shape for s in counts[1:3]] == ["samples, truncates, keyed", "samples, keyed"]
    assert counts[2].capture_reasons == ["sampler shape first met (samples, keyed)"]
    assert counts[3].capture_reasons == counts[4].capture_reasons == []


def test_mixed_settings_in_one_batch_equal_each_row_alone():
    check_mixed_batch_matches_rows_alone(tiny_model("llama"), CPUBackend())


def test_changing_any_per_row_setting_replays_the_same_graph():
    model = tiny_model("qwen2")
    ids, mask = prompts(3, seed=8)
    engine = engine_on(model)
    variants = [
        {"temperature": 0.5},
        {"top_k": 7},
        {"top_p": 0.7, "min_p": 0.1},
        {"repetition_penalty": 1.4, "min_new_tokens": 3},
        {"logprobs_mode": "raw", "return_logprobs": True},
    ]
    base = {"do_sample": True, "max_new_tokens": NEW, "seed": 2, **NO_EOS}
    for change in variants:
        params = SamplingParams(**{**base, **change})
        graph = engine.generate(ids, mask, params)
        eager = engine_on(model, graph=False).generate(ids, mask, params)
        assert torch.equal(graph.sequences, eager.sequences), change
    # the first call, the first truncating call (top-k), the first penalty call, the first
    # log-prob call (the shape only grows)
    assert graph.stats.captures == 4


# ---- log-probs --------------------------------------------------------------------------------
def test_logprob_modes_match_teacher_forced_recomputation():
    check_logprob_modes_match_recomputation(tiny_model("llama"), CPUBackend(), atol=1e-4)


# ---- seeds ------------------------------------------------------------------------------------
def test_seeded_call_leaves_the_global_rng_alone_and_is_reproducible():
    model = tiny_model("llama")
    ids, mask = prompts(3, seed=2)
    engine = engine_on(model)
    params = SamplingParams(do_sample=True, top_k=20, max_new_tokens=NEW, seed=9, **NO_EOS)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = engine.generate(ids, mask, params)
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(5)  # the training side moves the global generator on
    second = engine.generate(ids, mask, params)
    assert torch.equal(first.sequences, second.sequences)
    # a call seed s gives prompt row i the stream of seed s + i: row 2 alone with seed 11
    alone = engine_on(model).generate(
        ids[2:], mask[2:], SamplingParams(**{**_fields(params), "seed": 11})
    )
    assert torch.equal(alone.sequences[0], first.sequences[2])
    # unseeded sampling still draws from (and advances) the shared generator, as generate does
    unseeded = SamplingParams(do_sample=True, top_k=20, max_new_tokens=NEW, **NO_EOS)
    state = torch.get_rng_state()
    engine.generate(ids, mask, unseeded)
    assert not torch.equal(torch.get_rng_state(), state)
    # a greedy call replaying a sampling graph (one that does not truncate) leaves it alone
    state = torch.get_rng_state()
    greedy = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS))
    assert greedy.stats.captures == 2 and torch.equal(torch.get_rng_state(), state)
    assert greedy.stats.sampler_shape == "samples, keyed"


def test_seeded_row_does_not_depend_on_its_batch_companions():
    model = tiny_model("llama")
    ids, mask = prompts(4, seed=3)
    row = SamplingParams(do_sample=True, temperature=1.5, max_new_tokens=NEW, seed=42, **NO_EOS)
    companions = [
        SamplingParams(do_sample=True, max_new_tokens=NEW, seed=s, **NO_EOS) for s in (1, 2, 3)
    ]
    a = engine_on(model).generate(ids, mask, [row, *companions])
    b = engine_on(model).generate(
        ids[[1, 0, 2, 3]], mask[[1, 0, 2, 3]], [companions[0], row, *companions[1:]]
    )
    # row 0 of a is the prompt of row 1 of b: same prompt, same seed
    assert torch.equal(a.sequences[0], b.sequences[1])


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in params.__dataclass_fields__}


# ---- stop ids ---------------------------------------------------------------------------------
def test_stop_token_ids_end_rows_and_are_reported_without_recapture():
    model = tiny_model("llama")
    ids, mask = prompts(3, seed=5)
    width = ids.shape[1]
    engine = engine_on(model, batch_ladder=None)  # rows end early: one graph, no smaller
    free = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS))
    stop = int(free.sequences[0, width + 2])  # row 0's third token
    stopped = engine.generate(
        ids, mask, SamplingParams(max_new_tokens=NEW, stop_token_ids=[stop], **NO_EOS)
    )
    assert stopped.stats.captures == 1
    assert stopped.finish_reasons[0] == "stop" and stopped.stop_token_ids[0] == stop
    assert stopped.response_lengths[0] <= 3
    for row in range(3):
        tokens = free.sequences[row, width:].tolist()
        if stop not in tokens:
            assert stopped.finish_reasons[row] == "length" and stopped.stop_token_ids[row] is None
    pinned = engine.generate(
        ids,
        mask,
        SamplingParams(max_new_tokens=NEW, min_new_tokens=5, stop_token_ids=[stop], **NO_EOS),
    )
    assert min(pinned.response_lengths.tolist()) >= 5  # min_new_tokens blocks stop ids too
    eos = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, eos_token_id=stop))
    assert eos.finish_reasons[0] == "eos" and eos.stop_token_ids[0] == stop


# ---- settings ---------------------------------------------------------------------------------
def test_vllm_aliases_map_one_to_one_and_the_rest_are_refused_by_name():
    aliased = SamplingParams.from_vllm(temperature=1.0, n=3, max_tokens=5, min_tokens=2, logprobs=0)
    assert (aliased.num_return_sequences, aliased.max_new_tokens) == (3, 5)
    assert aliased.min_new_tokens == 2 and aliased.return_logprobs
    assert SamplingParams(stop_token_ids=[4, 5]).stop_token_ids == (4, 5)
    vllm = SamplingParams.from_vllm(temperature=0.0, top_k=-1, max_tokens=4)
    assert not vllm.do_sample and vllm.top_k is None
    assert SamplingParams.from_vllm(temperature=0.6, n=2).do_sample
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_vllm(logit_bias={3: 1.0})
    assert SamplingParams.from_vllm(logprobs=2).top_logprobs == 2  # vLLM's top-k alternatives
    with pytest.raises(ValueError, match="num_return_sequences"):
        SamplingParams.from_vllm(n=2, num_return_sequences=2)
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="processed")
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="do_sample=False"):
        SamplingParams(do_sample=True, temperature=0)
    assert SamplingParams(temperature=0).temperature == 0  # greedy ignores it, as generate


@pytest.mark.parametrize(
    ("temperature", "error", "match"),
    [
        (-1.0, ValueError, "temperature must be >= 0 and finite, got -1.0"),
        (float("nan"), ValueError, "temperature must be >= 0 and finite, got nan"),
        ("0.5", TypeError, r"SamplingParams\.temperature must be a float, got '0\.5'"),
        (None, TypeError, r"SamplingParams\.temperature must be a float, got None"),
    ],
)
def test_vllm_temperatures_vllm_refuses_are_refused_with_the_field_named(temperature, error, match):
    """vLLM raises for a negative temperature; graphcap made -1 and NaN greedy without a word,
    took the string "0.5" the constructor refuses, and said nothing of the field for None."""
    with pytest.raises(error, match=match):
        SamplingParams.from_vllm(temperature=temperature)


def test_vllm_temperatures_as_numbers_keep_their_meaning():
    for zero in (0, 0.0, torch.tensor(0.0), np.float32(0.0)):
        assert not SamplingParams.from_vllm(temperature=zero).do_sample  # vLLM's greedy
    for value in (0.5, 1, torch.tensor(0.5), np.float64(0.5)):
        params = SamplingParams.from_vllm(temperature=value)
        assert params.do_sample and params.temperature == float(value)


def test_a_top_k_beyond_the_vocabulary_keeps_every_token_as_generate_does():
    """generate clamps top_k to the vocabulary; graphcap wrote 2**63 into an int64 tensor and
    failed with torch's "Overflow when unpacking long long"."""
    model = tiny_model("llama")
    ids, mask = prompts(2)
    engine = engine_on(model)
    tokens = {}
    for top_k in (2**63, 10**30, model.config.vocab_size):
        params = SamplingParams(max_new_tokens=6, do_sample=True, top_k=top_k, seed=5)
        tokens[top_k] = engine.generate(ids, mask, params).sequences
    assert torch.equal(tokens[2**63], tokens[model.config.vocab_size])
    assert torch.equal(tokens[10**30], tokens[model.config.vocab_size])


def test_the_constructor_takes_vllms_aliases_for_one_release_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match=r"from_vllm"):
        aliased = SamplingParams(do_sample=True, n=3, max_tokens=5, min_tokens=2, logprobs=0)
    assert aliased == SamplingParams(
        do_sample=True,
        num_return_sequences=3,
        max_new_tokens=5,
        min_new_tokens=2,
        return_logprobs=True,
    )
    with pytest.warns(DeprecationWarning):
        assert SamplingParams(logprobs=2).top_logprobs == 2
    for given in (2, 1):  # a field given at its default conflicts too (it returned 2 samples)
        with pytest.raises(ValueError, match="'num_return_sequences' and its vLLM alias 'n'"):
            SamplingParams(n=2, num_return_sequences=given)
    with pytest.raises(ValueError, match="'max_new_tokens' and its vLLM alias 'max_tokens'"):
        SamplingParams(max_new_tokens=16, max_tokens=8)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="do_sample=True"):
        SamplingParams(n=2)  # still greedy unless do_sample says otherwise
    for name, value in (("best_of", 1), ("stop", None), ("logit_bias", {})):
        with pytest.raises(TypeError, match=rf"{name}.*from_vllm"):  # vLLM's other names
            SamplingParams(**{name: value})


def test_per_row_lists_are_checked():
    model = tiny_model("gpt2")
    ids, mask = prompts(2)
    engine = engine_on(model, graph=False)
    with pytest.raises(ValueError, match="one per prompt row"):
        engine.generate(ids, mask, [SamplingParams()])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(ids, mask, [SamplingParams(max_new_tokens=3), SamplingParams()])
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate(ids, mask, SamplingParams(stop_token_ids=[10_000]))
