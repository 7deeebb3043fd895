"""Capture and replay the way the rollout engine does, valid for every backend.

On a device, libraries initialise lazily on the first call (which must not happen inside a
capture), so work is warmed up once before capture, on a side stream where the backend captures
on one. After capture and replay the host synchronises through the backend before reading.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from graphcap.backend import Backend

T = TypeVar("T")


def warm_up(backend: Backend, fn: Callable[[], T]) -> T:
    """Run ``fn`` eagerly once, as the rollout engine does before capturing it."""
    if not backend.capture_needs_side_stream:
        result = fn()
        backend.synchronize()
        return result
    side = backend.new_stream()
    side.wait_stream(backend.current_stream())
    with backend.stream(side):
        result = fn()
    backend.current_stream().wait_stream(side)
    backend.synchronize()
    return result


def capture(backend: Backend, fn: Callable[[], T], pool: Any | None = None) -> tuple[Any, T]:
    """Record ``fn`` into a new graph; returns the graph and what ``fn`` returned.

    Tensors ``fn`` allocates hold no computed values until the first replay.
    """
    graph = backend.create_graph()
    with backend.capture_to_graph(graph, pool=pool):
        result = fn()
    backend.synchronize()
    return graph, result


def replay(backend: Backend, graph: Any, times: int = 1) -> None:
    """Replay ``graph`` ``times`` times and wait for it, so the host can read the results."""
    for _ in range(times):
        backend.replay_graph(graph)
    backend.synchronize()
