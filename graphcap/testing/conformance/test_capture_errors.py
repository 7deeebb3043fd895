"""A capture that cannot be recorded fails loudly and leaves the backend usable.

The rollout engine relies on this to fall back to eager after a failed capture: the error must
surface at capture (never a graph that silently recorded less), the backend must no longer
report a capture in progress, and new work, including a new capture, must run normally.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from graphcap.backend import Backend
from graphcap.testing.graphs import capture, replay, warm_up

HOST_SYNCS: dict[str, Callable[[torch.Tensor], object]] = {
    "item": lambda t: t.sum().item(),
    "bool": lambda t: bool(t.sum() > 0),
    "nonzero": lambda t: torch.nonzero(t),
}


@pytest.mark.parametrize("sync", list(HOST_SYNCS))
def test_host_sync_inside_capture_fails_loudly(gc_graph_backend: Backend, sync: str) -> None:
    backend = gc_graph_backend
    x = torch.ones(4, device=backend.device)
    warm_up(backend, lambda: HOST_SYNCS[sync](x * 2))
    stream_before = backend.current_stream()
    graph = backend.create_graph()
    with pytest.raises(RuntimeError), backend.capture_to_graph(graph):
        HOST_SYNCS[sync](x * 2)
    assert backend.is_current_stream_capturing() is False, "still capturing after the failure"
    assert backend.current_stream() == stream_before, (
        "the failed capture left another stream current"
    )
    # Usable afterwards: eager work and a fresh capture behave normally.
    eager = x + 1
    backend.synchronize()
    assert eager.cpu().tolist() == [2.0] * 4
    fresh, result = capture(backend, lambda: x * 5)
    replay(backend, fresh)
    assert result.cpu().tolist() == [5.0] * 4
