"""Every step's scores and logits recorded inside the step (``output_scores``/``output_logits``):
graph equals eager exactly, both equal ``generate``'s within float rounding."""

from __future__ import annotations

import pytest
import torch
from rollout_models import PAD, make_engine, prompts, run, tiny_model
from transformers import GenerationConfig

from graphcap.rollout import SamplingParams

NEW = 7
SETTINGS = {
    "greedy": {},
    "sampled": {"do_sample": True, "top_k": 16, "top_p": 0.9, "temperature": 0.8, "seed": 3},
    "min-new": {"min_new_tokens": 4, "eos_token_id": [1, 9]},
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_recorded_scores_are_the_same_in_graph_and_eager_steps(family, name):
    model = tiny_model(family)
    ids, mask = prompts(3)
    params = {"max_new_tokens": NEW, "output_scores": True, "output_logits": True}
    params.update(SETTINGS[name])
    graph = run(model, ids, mask, True, **params)
    eager = run(model, ids, mask, False, **params)
    assert graph.stats.path == "static_graph"
    assert torch.equal(graph.sequences, eager.sequences)
    assert graph.scores.shape == (3, graph.stats.steps + 1, model.config.vocab_size)
    assert torch.equal(graph.scores, eager.scores) and torch.equal(graph.logits, eager.logits)


def test_scores_match_generate_per_step():
    model = tiny_model("llama")
    ids, mask = prompts(2, padded=False)
    expected = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        pad_token_id=PAD,
        repetition_penalty=1.3,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    config = GenerationConfig(
        max_new_tokens=NEW, repetition_penalty=1.3, output_scores=True, output_logits=True
    )
    got = run(model, ids, mask, True, **vars(SamplingParams.from_generation_config(config)))
    steps = len(expected.scores)
    torch.testing.assert_close(got.scores[:, :steps], torch.stack(expected.scores, 1))
    torch.testing.assert_close(got.logits[:, :steps], torch.stack(expected.logits, 1))


def test_nothing_is_recorded_unless_asked():
    result = run(tiny_model("llama"), *prompts(2), True, max_new_tokens=NEW)
    assert result.scores is None and result.logits is None


def test_the_continuous_path_refuses_scores():
    from rollout_models import make_engine

    engine = make_engine(tiny_model("llama"), continuous_batch_size=2)
    with pytest.raises(ValueError, match="continuous"):
        engine.generate(*prompts(3), SamplingParams(max_new_tokens=NEW, output_scores=True))


#: ids that end rows at many different steps with the tiny models' random weights (the ladder's)
STOPS = [3, 5, 9, 17, 33, 40, 60, 77, 90, 101]


def test_a_call_without_records_after_one_with_them_runs_as_if_none_ever_did():
    """The sampler's shape only grew: after one call with ``output_scores``, every later call
    of the engine (the drop-in's included) kept writing records and ran off the live-row
    ladder. Now the records are the call's own: only the one asked for is allocated, and the
    next call without records holds none, takes the ladder and equals a fresh engine's call."""
    model = tiny_model("llama")
    ids, mask = prompts(8, seed=8)
    plain = SamplingParams(max_new_tokens=20, eos_token_id=STOPS)
    fresh = make_engine(model, eos_check_interval=2).generate(ids, mask, plain)
    assert len(fresh.stats.batch_steps) > 1  # on the ladder
    engine = make_engine(model, eos_check_interval=2)
    recorded = engine.generate(ids, mask, plain, output_scores=True)
    assert recorded.scores is not None and recorded.logits is None
    assert engine.step.state.logits is None  # only the record asked for
    assert recorded.stats.batch_steps == {}  # calls that record stay off the ladder
    again = engine.generate(ids, mask, plain)
    assert engine.step.state.scores is None and engine.step.state.logits is None
    assert again.scores is None and again.stats.batch_steps == fresh.stats.batch_steps
    assert torch.equal(again.sequences, fresh.sequences)
    logits = engine.generate(ids, mask, plain, output_logits=True)
    assert logits.logits is not None and engine.step.state.scores is None
    both = make_engine(model, eos_check_interval=2).generate(
        ids, mask, plain, output_scores=True, output_logits=True
    )
    assert torch.equal(logits.logits, both.logits) and torch.equal(recorded.scores, both.scores)
