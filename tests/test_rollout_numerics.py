"""Numerics a long RL job meets: a diverged policy (NaN weights) and a vanishing temperature."""

from __future__ import annotations

import warnings

import pytest
import torch
from rollout_models import prompts, tiny_model

from graphcap.errors import NonFiniteLogitsWarning
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.sampling import sanitise

MODES = {
    "eager": {"enable_graph_capture": False},
    "graph": {"enable_graph_capture": True},
    "continuous": {"enable_graph_capture": True, "continuous_batch_size": 2},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_sampling_from_a_diverged_model_warns_and_counts_the_draws(mode):
    """NaN logits are sanitised before the draw (a NaN reaching multinomial kills a CUDA
    context), which makes the tokens uniform: the call warns and counts them."""
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(3)
    engine = RolloutEngine(model, RolloutConfig(**MODES[mode]))
    sampling = SamplingParams(max_new_tokens=6, do_sample=True, eos_token_id=[])
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteLogitsWarning)
        assert engine.generate(ids, mask, sampling).stats.nan_draws == 0
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.warns(NonFiniteLogitsWarning, match="NaN"):
        stats = engine.generate(ids, mask, sampling).stats
    assert stats.nan_draws == 3 * 6  # every live row, every token


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("temperature", [1e-38, 1e-30])
@pytest.mark.parametrize("seed", [None, 3], ids=["generator", "seeded"])
def test_a_vanishing_temperature_samples_the_argmax(graph, temperature, seed):
    """Scores / 1e-38 overflow float32 (+inf for positive scores, -inf for negative ones): the
    distribution's limit is the argmax, not a uniform draw among the overflowed tokens."""
    model = tiny_model("llama")
    ids, mask = prompts(3)
    engine = RolloutEngine(model, RolloutConfig(enable_graph_capture=graph))
    greedy = engine.generate(ids, mask, SamplingParams(max_new_tokens=8)).sequences
    sampled = SamplingParams(max_new_tokens=8, do_sample=True, temperature=temperature, seed=seed)
    torch.manual_seed(0)
    assert torch.equal(engine.generate(ids, mask, sampled).sequences, greedy)


def test_the_limit_keeps_the_largest_unwarped_scores():
    """Rows that overflowed (+inf), all underflowed (-inf), or are plain keep what the limit
    keeps; NaN and finished rows go flat."""
    unwarped = torch.tensor(
        [
            [1.0, 3.0, 2.0, -5.0],
            [-4.0, -1.0, -2.0, -3.0],
            [0.1, 0.3, 0.2, 0.0],
            [0.0, 1.0, 1.0, 1.0],
        ]
    )
    warped = unwarped * 1e39  # what a temperature of 1e-39 does
    warped[2] = unwarped[2]
    warped[3, 0] = float("nan")
    finished = torch.tensor([False, False, False, False])
    out = sanitise(warped, finished, unwarped)
    assert out[0].argmax() == 1 and torch.isinf(out[0]).sum() == 3
    assert out[1].argmax() == 1 and torch.isinf(out[1]).sum() == 3
    assert torch.equal(out[2], unwarped[2])
    assert torch.equal(out[3], torch.zeros(4))
