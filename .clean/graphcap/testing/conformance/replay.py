"""Replaying as the rollout engine does: the graph ``times`` times, then one synchronise.

Captures in the checks go through the engine's own routine,
:func:`graphcap.rollout.holder.capture.capture_step` (warm-up on the backend's capture stream where
it needs one, the explicit ``stream=``, rollback of every buffer and generator).
"""

from __future__ import annotations

from graphcap.backend import Backend


def replay(backend: Backend, graph: object, times: int = 1) -> None:
    """Replay ``graph`` ``times`` times and wait for it, so the host can read the results."""
    for _ in range(times):
        backend.replay_graph(graph)
    backend.synchronize()
