"""A capture that cannot be recorded fails loudly and leaves the backend usable.

The rollout engine relies on this to fall back to eager after a failed capture: the error must
surface at capture (never a graph that silently recorded less), the backend must no longer
report a capture in progress, and new work, including a new capture, must run normally. The
capture goes through the engine's ``capture_step``, which must also roll back what the warm-up
and the failed capture wrote.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from graphcap.backend import Backend
from graphcap.rollout.holder.capture import capture_step
from graphcap.testing.conformance.replay import replay

HOST_SYNCS: dict[str, Callable[[torch.Tensor], object]] = {
    "item": lambda t: t.sum().item(),
    "bool": lambda t: bool(t.sum() > 0),
    "nonzero": lambda t: torch.nonzero(t),
}


@pytest.mark.parametrize("sync", list(HOST_SYNCS))
def test_host_sync_inside_capture_fails_loudly(gc_graph_backend: Backend, sync: str) -> None:
    backend = gc_graph_backend
    x = torch.ones(4, device=backend.device)
    written = torch.zeros(4, device=backend.device)

    def step() -> None:
        written.add_(1)
        HOST_SYNCS[sync](x * 2)

    stream_before = backend.current_stream()
    with pytest.raises(RuntimeError):
        capture_step(backend, step, [written], None)
    assert backend.is_current_stream_capturing() is False, "still capturing after the failure"
    assert backend.current_stream() == stream_before, (
        "the failed capture left another stream current"
    )
    assert written.cpu().tolist() == [0.0] * 4, "the failed capture was not rolled back"
    # Usable afterwards: eager work and a fresh capture behave normally.
    eager = x + 1
    backend.synchronize()
    assert eager.cpu().tolist() == [2.0] * 4
    out: dict[str, torch.Tensor] = {}

    def fresh_step() -> None:
        out["result"] = x * 5

    fresh = capture_step(backend, fresh_step, [], None)
    replay(backend, fresh)
    assert out["result"].cpu().tolist() == [5.0] * 4
