"""The backend-agnostic rollout engine: eager and static-graph generation for HF decoders.

Public API: :class:`RolloutEngine`, :class:`RolloutConfig`, :class:`SamplingParams`,
:class:`RolloutResult` (and :class:`RolloutStats`), plus :func:`load_weights_in_place` for
weight updates that keep a captured graph valid. See docs/rollout.md.
"""

from graphcap.rollout.config import RolloutConfig, SamplingParams
from graphcap.rollout.eligibility import GraphUnsupportedModelError
from graphcap.rollout.engine import (
    CaptureFallbackWarning,
    RolloutEngine,
    RolloutResult,
    RolloutStats,
)
from graphcap.rollout.weights import load_weights_in_place

__all__ = [
    "CaptureFallbackWarning",
    "GraphUnsupportedModelError",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutResult",
    "RolloutStats",
    "SamplingParams",
    "load_weights_in_place",
]
