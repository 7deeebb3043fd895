"""Capturing a decode step into a graph: shared by the static and the continuous paths.

A device graph needs the step warmed up once before capture (on the stream the capture uses),
and neither the warm-up nor the capture may leave a trace: every buffer the step writes and the
generators are put back as they were, so the first replay performs the first real step.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphcap.backend import Backend
from graphcap.errors import CaptureFallbackWarning, GraphUnsupportedError
from graphcap.rollout.holder.tracing import graph_step, install_capture_detection


@dataclass
class Snapshot:
    """Copies of every small mutable buffer, to undo a warm-up or a failed capture."""

    saved: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def take(cls, tensors: list[torch.Tensor]) -> Snapshot:
        return cls([(t, t.clone()) for t in tensors])

    def restore(self) -> None:
        for live, copy in self.saved:
            live.copy_(copy)


def capture_step(
    backend: Backend,
    step: Callable[[], None],
    mutable: list[torch.Tensor],
    generator: torch.Generator | None,
    pool: object | None = None,
    timings: dict[str, float] | None = None,
) -> object:
    """Warm up ``step``, capture it into a new graph and return the graph.

    ``pool``: a handle from ``backend.graph_pool_handle()`` that several graphs share (the
    per-position path passes one for its whole set); ``None`` asks the backend for one.
    ``timings``, where given, receives ``warmup_s``: the warm-up's seconds (a compiled step
    compiles in it, and every kernel's first use in the process happens in it).

    Every tensor in ``mutable``, the backend's RNG state and ``generator`` are left as they were,
    also when capture fails (the exception propagates after the rollback). The warm-up and the
    capture run as a graph step (:mod:`graphcap.rollout.holder.tracing`): transformers then takes
    its graph-safe paths on every backend, as it does under a CUDA capture.
    """
    install_capture_detection()
    snapshot = Snapshot.take(mutable)
    rng = backend.get_rng_state()
    gen_state = None if generator is None else generator.get_state()

    def rollback() -> None:
        snapshot.restore()
        backend.set_rng_state(rng)
        if generator is not None:
            generator.set_state(gen_state)

    stream = backend.capture_stream() if backend.capabilities.capture_needs_side_stream else None
    start = time.perf_counter()
    try:
        graph = backend.create_graph()
        if graph is None:
            raise GraphUnsupportedError(f"backend {backend.name!r}: create_graph() returned None")
        if generator is not None:
            backend.register_generator(graph, generator)
        if stream is not None:
            stream.wait_stream(backend.current_stream())  # the prefill's work first
            with backend.stream(stream), graph_step():
                step()
        else:
            with graph_step():
                step()
        backend.synchronize()
        if timings is not None:
            timings["warmup_s"] = time.perf_counter() - start
        rollback()
        if pool is None:
            pool = backend.graph_pool_handle()
        with backend.capture_to_graph(graph, pool=pool, stream=stream), graph_step():
            step()
        backend.synchronize()
        return graph
    finally:
        rollback()


def fallback_reason(exc: BaseException) -> str:
    """Record a failed capture as the reason graphs are off, with the one warning it gets."""
    reason = f"graph capture failed: {type(exc).__name__}: {exc}"
    warnings.warn(
        f"{reason}; this call finishes eagerly and the engine stays eager from now on",
        CaptureFallbackWarning,
        stacklevel=4,
    )
    return reason
