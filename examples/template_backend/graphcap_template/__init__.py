"""Template graphcap backend: everything a vendor writes, in one file.

It runs on the CPU and delegates its graphs to graphcap's CPU reference graph, so it passes the
conformance suite anywhere. For a real device, replace each line marked ``DEVICE:`` with the call
named in its comment (shown for a hypothetical ``torch.mydev`` module) and set the class fields.

Check it with:  GRAPHCAP_BACKEND=template python -m graphcap.testing
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

from graphcap import PLUGIN_API_VERSION, Availability, Backend, hookimpl
from graphcap.cpu.graph import CPUGraph, is_capturing


class TemplateBackend(Backend):
    name: ClassVar[str] = "template"  # what users put in GRAPHCAP_BACKEND
    # Auto-selection picks the available backend of highest priority; cpu is 0, accelerators are
    # above it. The template sits below cpu so it is used only when asked for by name.
    priority: ClassVar[int] = -10
    device_type: ClassVar[str] = "cpu"  # DEVICE: your torch device type, e.g. "mydev"
    # Declared capabilities, verified by the conformance suite:
    captures_graphs: ClassVar[bool] = True  # create_graph() returns a graph (False: eager only)
    rng_in_graph: ClassVar[bool] = True  # replays draw fresh numbers from the default generator
    collectives_in_graph: ClassVar[bool] = False  # collectives can be captured into a graph
    capture_needs_side_stream: ClassVar[bool] = False  # capture on the default stream is refused

    @classmethod
    def availability(cls) -> Availability:
        # DEVICE: probe without raising, e.g. try to import the device library and count devices,
        # and say why not: Availability(False, "mydev library not found: pip install ...").
        return Availability(True, "template backend on the CPU, using graphcap's reference graphs")

    # The four graph hooks. A device that cannot capture returns None from create_graph() and
    # leaves out the other three: the base class then refuses them and the engine runs eagerly.
    def create_graph(self) -> CPUGraph:
        return CPUGraph()  # DEVICE: torch.mydev.Graph()

    def capture_to_graph(
        self,
        graph: CPUGraph,
        pool: Any | None = None,
        stream: Any | None = None,
        capture_error_mode: str | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        # DEVICE: torch.mydev.graph(graph, pool=pool, stream=stream,
        #                           capture_error_mode=capture_error_mode or "global")
        # It must raise (not record less) when the work inside syncs with the host, and leave
        # the current stream as it found it, also when it fails.
        return graph.capture()

    def replay_graph(self, graph: CPUGraph) -> None:
        graph.replay()  # DEVICE: graph.replay()

    def is_current_stream_capturing(self) -> bool:
        return is_capturing()  # DEVICE: torch.mydev.is_current_stream_capturing()

    # Optional: graph_pool_handle() (DEVICE: torch.mydev.graph_pool_handle()) lets graphs share
    # memory. Streams, synchronize, RNG state and memory figures default to
    # torch.get_device_module(device_type); override only what your device does differently.


@hookimpl
def graphcap_api_version() -> int:
    """The Backend contract version this plugin was written for; graphcap refuses others."""
    return PLUGIN_API_VERSION


@hookimpl
def graphcap_backends() -> list[type[Backend]]:
    return [TemplateBackend]
