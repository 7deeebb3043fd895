"""CPU backend: graphs that record aten operations and replay exactly those.

This is the test bed for every graph path: frozen host values, stale masks and missing replays
show up as wrong tokens here, as they would on a device.
"""

from __future__ import annotations

from typing import ClassVar

from graphcap.backend import Availability, Backend, GraphBackend, MemoryRegion
from graphcap.cpu.graph import ReferenceGraphs
from graphcap.cpu.region import ReferenceRegion
from graphcap.exact_ops import REFERENCE, ExactOps
from graphcap.hookspecs import PLUGIN_API_VERSION, hookimpl


class CPUBackend(GraphBackend):
    name: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 0
    device_type: ClassVar[str] = "cpu"
    rng_in_graph: ClassVar[bool] = True
    #: A collective is an aten operation like any other: recorded, and issued again on replay
    #: (each rank replays its own graph, so the collectives pair up as in eager steps).
    collectives_in_graph: ClassVar[bool] = True
    #: The block table runs on the reference backend, so every graph-path test exercises it.
    kv_block_size: ClassVar[int | None] = 16
    graph_class: ClassVar[str] = "CPUGraph"
    capture_hint: ClassVar[str] = (
        "The code under capture raised it; run the same code eagerly to see where."
    )

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True, "built in; graphs record and replay aten operations")

    def graph_library(self) -> type[ReferenceGraphs]:
        return ReferenceGraphs

    def memory_region(self) -> MemoryRegion:
        """Regions that model a device's release and remap (:mod:`graphcap.cpu.region`)."""
        return ReferenceRegion()

    def exact_ops(self) -> ExactOps:
        """The reference trainer-exact operations (:mod:`graphcap.exact_ops`)."""
        return REFERENCE


class CPUPlugin:
    """The built-in plugin object registered with pluggy, like an installed one."""

    @hookimpl
    def graphcap_api_version(self) -> int:
        return PLUGIN_API_VERSION

    @hookimpl
    def graphcap_backends(self) -> list[type[Backend]]:
        return [CPUBackend]
