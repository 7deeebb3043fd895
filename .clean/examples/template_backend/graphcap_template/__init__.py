"""Template graphcap backend: everything a vendor writes, in one file.

It runs on the CPU and delegates its graphs to graphcap's CPU reference graph, so it passes the
conformance suite anywhere. For a real device, replace each line marked ``DEVICE:`` with the call
named in its comment (shown for a hypothetical ``torch.mydev`` module) and set the class fields.

Check it with:  GRAPHCAP_BACKEND=template python -m graphcap.testing
"""

from __future__ import annotations

from typing import Any, ClassVar

from graphcap import PLUGIN_API_VERSION, Availability, Backend, GraphBackend, hookimpl
from graphcap.cpu.graph import ReferenceGraphs


class TemplateBackend(GraphBackend):
    name: ClassVar[str] = "template"  # what users put in GRAPHCAP_BACKEND
    # Auto-selection picks the available backend of highest priority; cpu is 0, accelerators are
    # above it. The template sits below cpu so it is used only when asked for by name.
    priority: ClassVar[int] = -10
    device_type: ClassVar[str] = "cpu"  # DEVICE: your torch device type, e.g. "mydev"
    # The graph hooks come from GraphBackend, on a graph library shaped like torch.cuda's: the
    # graph class named here, graph(...), is_current_stream_capturing(), graph_pool_handle().
    graph_class: ClassVar[str] = "CPUGraph"  # DEVICE: torch.mydev's graph class, e.g. "Graph"
    # Added to the error of a failed capture: the usual causes on your device.
    capture_hint: ClassVar[str] = "Work inside a capture must not synchronise with the host."
    # Declared capabilities, verified by the conformance suite:
    rng_in_graph: ClassVar[bool] = True  # replays draw fresh numbers from the default generator
    collectives_in_graph: ClassVar[bool] = False  # collectives can be captured into a graph
    capture_needs_side_stream: ClassVar[bool] = False  # capture on the default stream is refused

    @classmethod
    def availability(cls) -> Availability:
        # DEVICE: probe without raising, e.g. try to import the device library and count devices,
        # and say why not: Availability(False, "mydev library not found: pip install ...").
        return Availability(True, "template backend on the CPU, using graphcap's reference graphs")

    def graph_library(self) -> Any:
        # DEVICE: delete this method: the graph library is then your device module, torch.mydev
        # (torch.get_device_module(device_type)). Its graph(...) must raise (not record less)
        # when the work inside syncs with the host. A device that cannot capture subclasses
        # Backend instead: create_graph() returns None and the engine runs eagerly.
        return ReferenceGraphs

    # Streams, synchronize, RNG state and memory figures default to
    # torch.get_device_module(device_type); override only what your device does differently.


@hookimpl
def graphcap_api_version() -> int:
    """The Backend contract version this plugin was written for; graphcap refuses others."""
    return PLUGIN_API_VERSION


@hookimpl
def graphcap_backends() -> list[type[Backend]]:
    return [TemplateBackend]
