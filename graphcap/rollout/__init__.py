"""The backend-agnostic rollout engine for HF decoders: eager, static-graph and continuous paths.

Public API: :class:`RolloutEngine`, :class:`RolloutConfig`, :class:`SamplingParams`,
:class:`RolloutResult` (and :class:`RolloutStats`), plus :func:`load_weights_in_place` for
weight updates that keep a captured graph valid and :func:`generate_data_parallel` for
data-parallel rollouts under torchrun, and :func:`accelerate_generate` to serve an existing
model's ``generate`` (docs/trainers.md; its default config: :func:`drop_in_default_config`), and
:func:`trainer_exact` / :func:`token_logprobs`, the trainer's side of trainer-exact rollouts
(both sides for TRL's GRPOTrainer: :func:`trl_trainer_exact`).
See docs/rollout.md and docs/continuous.md.
"""

from graphcap.errors import (
    CaptureFallbackWarning,
    GraphUnsupportedModelError,
    HeldMemoryWarning,
    RequestTooLargeError,
)
from graphcap.rollout.data_parallel import generate_data_parallel
from graphcap.rollout.drop_in import (
    AcceleratedGenerate,
    accelerate_generate,
    drop_in_default_config,
    restore_generate,
)
from graphcap.rollout.engine import RolloutEngine
from graphcap.rollout.exact import token_logprobs, trainer_exact
from graphcap.rollout.results import RolloutResult, RolloutStats
from graphcap.rollout.settings import RolloutConfig, SamplingParams
from graphcap.rollout.trl_exact import trl_trainer_exact
from graphcap.rollout.weights import WeightsLoaded, load_weights_in_place

__all__ = [
    "AcceleratedGenerate",
    "CaptureFallbackWarning",
    "GraphUnsupportedModelError",
    "HeldMemoryWarning",
    "RequestTooLargeError",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutResult",
    "RolloutStats",
    "SamplingParams",
    "WeightsLoaded",
    "accelerate_generate",
    "drop_in_default_config",
    "generate_data_parallel",
    "load_weights_in_place",
    "restore_generate",
    "token_logprobs",
    "trainer_exact",
    "trl_trainer_exact",
]
