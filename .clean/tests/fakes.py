"""Backends that misbehave or declare less, shared by the rollout tests."""

from __future__ import annotations

from typing import Any

from graphcap.backend import Backend
from graphcap.cpu import CPUBackend


class NoGraphBackend(Backend):
    """A backend that cannot capture: create_graph() returns None."""

    name = "nograph"


class FailingCaptureBackend(CPUBackend):
    """Captures fail from the ``fail_at``-th capture on (counting from 1)."""

    def __init__(self, fail_at: int = 1):
        super().__init__()
        self.fail_at, self.seen = fail_at, 0

    def capture_to_graph(self, graph: Any, pool=None, stream=None, capture_error_mode=None):
        self.seen += 1
        if self.seen >= self.fail_at:
            raise RuntimeError("planted capture failure")
        return super().capture_to_graph(graph, pool, stream, capture_error_mode)


class SideStreamBackend(CPUBackend):
    """The CPU reference backend declaring that capture needs a side stream (as CUDA does)."""

    capture_needs_side_stream = True


class NoRngGraphBackend(CPUBackend):
    """Declares that replays would not draw fresh random numbers."""

    rng_in_graph = False


class NoCollectivesGraphBackend(CPUBackend):
    """Declares that collectives cannot be captured."""

    collectives_in_graph = False
