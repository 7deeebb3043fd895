"""Exceptions and warnings graphcap raises, so callers can catch them by meaning rather than by
message."""

from __future__ import annotations

import warnings

_warned: set[str] = set()


def warn_once(message: str) -> None:
    """One ``UserWarning`` per distinct message per process, as generate's ``warning_once``."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


class GraphcapError(RuntimeError):
    """Base class of every error graphcap raises on purpose."""


class BackendSelectionError(GraphcapError):
    """The requested backend is unknown, not installed, broken or unavailable."""


class PluginError(GraphcapError):
    """The plugin of the backend in use broke its contract (a hook raised or returned garbage)."""


class GraphCaptureError(GraphcapError):
    """Work issued during a capture cannot be recorded into a graph (a host sync, say)."""


class GraphUnsupportedError(GraphcapError):
    """A graph hook was called on a backend that cannot capture graphs."""


class GraphUnsupportedModelError(GraphcapError):
    """Graph capture was requested for a model configuration graphs cannot serve."""


class WouldRunEagerlyError(GraphcapError):
    """A call made with ``require_graph=True`` would run its steps eagerly; nothing ran.
    ``reason`` is the plan's reason (what ``stats.fallback_reason`` would have said)."""

    def __init__(self, reason: str):
        super().__init__(f"no graph would serve this call: {reason}")
        self.reason = reason


class CaptureFallbackWarning(RuntimeWarning):
    """A graph capture failed; the call finished eagerly and the engine stays eager."""


class CompileCacheWarning(RuntimeWarning):
    """A compile-cache file could not be used (corrupt, foreign) or written; graphcap compiled
    instead, so only time was lost."""


class NonFiniteLogitsWarning(RuntimeWarning):
    """Sampled tokens were drawn for rows whose logits held NaN (a diverged policy): they are
    uniform draws (a NaN must not reach the sampler), counted in ``RolloutStats.nan_draws``."""


class HeldMemoryWarning(UserWarning):
    """A sleep kept memory the trainer may expect back: storage of weights the trainer moved,
    which the engine's graphs still read (``SleepReport.still_held_bytes``)."""


class GenerateFallbackWarning(UserWarning):
    """A ``model.generate`` call under :func:`graphcap.rollout.accelerate_generate` went to
    transformers' own ``generate`` (the reason is in the message and in the drop-in's stats)."""


class RequestTooLargeError(GraphcapError, ValueError):
    """A call would allocate more than ``RolloutConfig.max_request_bytes`` or than the device has
    free (with what the engine holds counted as free: the call reuses or releases it). A
    ``ValueError`` too, as every refused input is."""


class WakeMemoryError(GraphcapError, MemoryError):
    """Waking an engine needs more device memory than is free: the trainer still holds what the
    sleep gave it. Nothing was mapped; the engine stays asleep and wakes at the next call once
    the memory is free (drop optimizer states or gradients, or offload them)."""


class DecodeStalledError(GraphcapError):
    """Decoding made no progress: rows that must finish within a known number of steps did not
    (neither the device's finished flags nor the host's budgets retired them: replays that
    change nothing together with host bookkeeping out of step). A guard against looping
    forever; the conformance suite finds the backends whose replays change nothing."""
