"""CPU backend: graphs that record aten operations and replay exactly those.

This is the test bed for every graph path: frozen host values, stale masks and missing replays
show up as wrong tokens here, as they would on a device.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

from graphcap.backend import Availability, Backend
from graphcap.cpu.graph import CPUGraph, is_capturing
from graphcap.hookspecs import PLUGIN_API_VERSION, hookimpl


class CPUBackend(Backend):
    name: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 0
    device_type: ClassVar[str] = "cpu"
    captures_graphs: ClassVar[bool] = True
    rng_in_graph: ClassVar[bool] = True
    #: A collective is an aten operation like any other: recorded, and issued again on replay
    #: (each rank replays its own graph, so the collectives pair up as in eager steps).
    collectives_in_graph: ClassVar[bool] = True

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True, "built in; graphs record and replay aten operations")

    def create_graph(self) -> CPUGraph:
        return CPUGraph()

    def capture_to_graph(
        self,
        graph: CPUGraph,
        pool: Any | None = None,
        stream: Any | None = None,
        capture_error_mode: str | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        # Pools, streams and error modes have no meaning on the CPU; accepted for the contract.
        return graph.capture()

    def replay_graph(self, graph: CPUGraph) -> None:
        graph.replay()

    def is_current_stream_capturing(self) -> bool:
        return is_capturing()


class CPUPlugin:
    """The built-in plugin object registered with pluggy, like an installed one."""

    @hookimpl
    def graphcap_api_version(self) -> int:
        return PLUGIN_API_VERSION

    @hookimpl
    def graphcap_backends(self) -> list[type[Backend]]:
        return [CPUBackend]
