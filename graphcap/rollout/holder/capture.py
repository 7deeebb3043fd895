"""Capturing a decode step into a graph: shared by the static and the continuous paths.

A device graph needs the step warmed up once before capture (on the stream the capture uses),
and neither the warm-up nor the capture may leave a trace: every buffer the step writes and the
generators are put back as they were, so the first replay performs the first real step.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

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


@dataclass(frozen=True)
class CaptureOutcome:
    """What one capture did: the graph, or ``None`` with the ``reason`` graphs are now off;
    its seconds, of which ``warmup_s`` the step's run before it (where a compiled step compiles
    and each kernel is first used); what it did with the compile cache (``None``: it compiled
    nothing)."""

    graph: object | None
    capture_s: float
    warmup_s: float
    reason: str | None = None
    compile_cache: str | None = None


class CaptureFailed(Exception):
    """A capture that failed (and was rolled back) after ``warmup_s`` seconds of warm-up; the
    failure is its ``__cause__``."""

    def __init__(self, warmup_s: float):
        super().__init__(f"capture failed after {warmup_s:.3f} s of warm-up")
        self.warmup_s = warmup_s


class Capturable(Protocol):
    """A step to capture, with the buffers it writes and the generator it draws from (a
    :class:`~graphcap.rollout.step.step.DecodeStep` is one)."""

    generator: torch.Generator | None

    def __call__(self) -> None: ...

    def mutable_tensors(self) -> list[torch.Tensor]: ...


@dataclass
class _BareStep:
    """A plain callable as :func:`capture_step`'s callers give it: the function, the tensors it
    writes and its generator."""

    run: Callable[[], None]
    mutable: list[torch.Tensor]
    generator: torch.Generator | None

    def __call__(self) -> None:
        self.run()

    def mutable_tensors(self) -> list[torch.Tensor]:
        return self.mutable


def capture_step(
    backend: Backend,
    step: Callable[[], None],
    mutable: list[torch.Tensor],
    generator: torch.Generator | None,
    pool: object | None = None,
    memory: Callable[[], AbstractContextManager[None]] = nullcontext,
) -> object:
    """Warm up ``step``, capture it into a new graph and return the graph; what a failure
    raised propagates. ``mutable``: the tensors ``step`` writes; ``generator``: the one it
    draws from, if any; ``memory``: where the capture allocates (see :func:`timed_capture`)."""
    try:
        return timed_capture(backend, _BareStep(step, mutable, generator), pool, memory)[0]
    except CaptureFailed as failed:
        cause = failed.__cause__
        raise cause from cause.__cause__


def timed_capture(
    backend: Backend,
    step: Capturable,
    pool: object | None = None,
    memory: Callable[[], AbstractContextManager[None]] = nullcontext,
) -> tuple[object, float]:
    """Warm up ``step``, capture it into a new graph; the graph and the warm-up's seconds.

    ``pool``: a handle from ``backend.graph_pool_handle()`` that several graphs share (the
    per-position path passes one for its whole set); ``None`` asks the backend for one. A
    failure raises :class:`CaptureFailed` with the warm-up's seconds (0 when the warm-up
    failed), the failure chained as its cause. ``memory``: where what the capture allocates
    lives (an engine's memory region); the warm-up runs outside it, so memory a library caches
    at its first use (a matrix library's workspace) is not given back with the engine's.

    Every tensor ``step`` writes (its ``mutable_tensors()``), the backend's RNG state and its
    ``generator`` are left as they were, also when capture fails (rolled back before
    :class:`CaptureFailed` is raised). The warm-up and the capture run as a graph step
    (:mod:`graphcap.rollout.holder.tracing`): transformers then takes its graph-safe paths on
    every backend, as it does under a CUDA capture.
    """
    generator = step.generator
    install_capture_detection()
    snapshot = Snapshot.take(step.mutable_tensors())
    rng = backend.get_rng_state()
    gen_state = None if generator is None else generator.get_state()

    def rollback() -> None:
        snapshot.restore()
        backend.set_rng_state(rng)
        if generator is not None:
            generator.set_state(gen_state)

    stream = backend.capture_stream() if backend.capabilities.capture_needs_side_stream else None
    start = time.perf_counter()
    warmup_s = 0.0
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
        warmup_s = time.perf_counter() - start
        rollback()
        if pool is None:
            pool = backend.graph_pool_handle()
        with memory(), backend.capture_to_graph(graph, pool=pool, stream=stream), graph_step():
            step()
        backend.synchronize()
        return graph, warmup_s
    except Exception as exc:
        raise CaptureFailed(warmup_s) from exc
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
