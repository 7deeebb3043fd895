"""torch_npu's generator rules inside ACL graphs, which changed at torch_npu 2.12.0.post3.

Before it (2.11.x, 2.12.0 to 2.12.0.post2) a graph knows the default generator and those
registered with ``NPUGraph.register_generator_state``; a draw inside a capture from any other
raises. ``capture_begin`` sets a capture flag on each generator the graph knows before it asks
ACL to begin, and ``capture_end`` clears the flags only after ACL ended the capture: a capture
that fails at its start or its end leaves them set, and from then on every draw from those
generators outside a capture raises ("Offset increment outside graph capture encountered
unexpectedly"): the next sampled call, an eager fallback that samples, a trainer's dropout. One
capture that succeeds with the same generators sets and clears the flags again
(:func:`recover`).

From 2.12.0.post3 each capture keeps its own generator state, created at the first draw inside
it: no registration (``register_generator_state`` is a deprecated no-op that warns), and a
failed capture leaves the generators as they were.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from graphcap.errors import GraphCaptureError
from graphcap_npu.probe import release

#: The first torch_npu release whose captures keep generator state per capture.
PER_CAPTURE_STATE = (2, 12, 0, 3)
#: Attribute of a graph: the explicit generators registered with it (what :func:`recover` needs).
_REGISTERED = "graphcap_generators"


def per_capture_state() -> bool:
    """Whether the imported torch_npu keeps generator state per capture (2.12.0.post3 on)."""
    found = release(str(getattr(sys.modules["torch_npu"], "__version__", "")))
    return found is not None and found >= PER_CAPTURE_STATE


def register(graph: Any, generator: torch.Generator) -> None:
    """Make draws from ``generator`` inside ``graph``'s capture legal, where the release needs
    it (remembered for :func:`recover`)."""
    if per_capture_state():
        return
    graph.register_generator_state(generator)
    setattr(graph, _REGISTERED, [*getattr(graph, _REGISTERED, []), generator])


def recover(npu: Any, graph: Any, device: torch.device) -> None:
    """After ``graph``'s capture failed on a torch_npu before 2.12.0.post3, clear the capture
    flags it may have left on its generators: one capture of one trivial kernel, on a fresh
    stream, with the same generators. When that capture fails too, the flags stay set and only
    a new process clears them: the error says so."""
    scratch = torch.zeros(1, device=device)
    clearing = npu.NPUGraph()
    for generator in getattr(graph, _REGISTERED, []):
        clearing.register_generator_state(generator)
    try:
        with npu.graph(clearing, stream=npu.Stream()):
            scratch.add_(1)
    except Exception as exc:
        version = getattr(sys.modules["torch_npu"], "__version__", "unknown")
        raise GraphCaptureError(
            f"a failed capture left the generators it knew in capture mode (torch_npu {version} "
            "sets that state before ACL begins a capture and clears it only after ACL ends one), "
            f"and the capture that would clear it failed too ({type(exc).__name__}: {exc}): "
            "every later draw from them on this device raises 'Offset increment outside graph "
            "capture encountered unexpectedly'. Restart the process; torch_npu 2.12.0.post3 or "
            "later keeps this state per capture"
        ) from exc
