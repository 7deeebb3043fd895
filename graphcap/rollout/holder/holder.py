"""The graph holder: the buffers and graphs of one signature, kept across calls.

One holder per engine. It drops what it holds when a call's signature differs (before the
replacement is allocated), captures through the one capture routine
(:func:`~graphcap.rollout.holder.capture.timed_capture`) with the process group's agreement, and
keeps graphs off for the engine after a failed capture. The static path holds one graph (key
:data:`FULL_STEP`) and one per size of the live-row ladder it reached; per-position graphs are
keyed by position (:class:`GraphKey`). Each key has a graph per sampler shape the engine's
calls ran (the shapes differ in what each call decides for itself, truncation;
:class:`~graphcap.rollout.sampling.SamplerShape`): the holder serves one call at a time, and
:meth:`GraphHolder.sampler_for` sets the call's shape, whose graphs the other methods then
mean. Keyed graphs, and every graph captured while another is held, share one memory pool.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from graphcap.backend import Backend, MemoryRegion
from graphcap.errors import WakeMemoryError
from graphcap.rollout.cache import LayerSpec
from graphcap.rollout.holder.agreement import GraphVerdict, RankAgreement
from graphcap.rollout.holder.capture import (
    CaptureFailed,
    CaptureOutcome,
    fallback_reason,
    timed_capture,
)
from graphcap.rollout.holder.compile_cache import CompileCache, shape_key
from graphcap.rollout.holder.weights import HeldWeights, WeightsMode
from graphcap.rollout.plan.fusion import ProjectionFusion
from graphcap.rollout.plan.regions import compiled_bookkeeping, compiled_regions, one_row_products
from graphcap.rollout.plan.signature import GraphSignature, attention_implementation
from graphcap.rollout.results import SleepReport
from graphcap.rollout.sampling import SamplerShape
from graphcap.rollout.settings.sampling_params import SamplingParams
from graphcap.rollout.step import DecodeStep


class GraphKey(NamedTuple):
    """A held graph's key: the full step (neither field set), the live-row ladder's step over
    the first ``rows`` rows, or the per-position graph of decode ``position``."""

    rows: int | None = None
    position: int | None = None

    def describe(self) -> str:
        """Why this graph is captured when it is missing (with a graph of this shape held)."""
        if self.rows is not None:
            return f"batch_ladder size {self.rows} first reached"
        return "per-position graph" if self.position is not None else "no full-size graph"


#: The key of the full step's graph.
FULL_STEP = GraphKey()


#: What a step's builder is handed: a context in which to allocate the K/V buffers, whose
#: contents need not survive a sleep (a call writes every column it reads).
KVMemory = Callable[[], contextlib.AbstractContextManager[None]]


@dataclass
class Held:
    """What one signature owns: its decode step (with cache, masks and state), its graphs and
    the memory region they live in (``None`` where the backend has none)."""

    signature: GraphSignature
    step: DecodeStep
    graphs: dict[tuple[SamplerShape, GraphKey], object] = field(default_factory=dict)
    pool: object | None = None
    region: MemoryRegion | None = None


class GraphHolder:
    """Hold, drop and capture. The engine asks it questions (:meth:`held_step`,
    :meth:`capture_count`) and tells it to :meth:`drop`; what it holds stays its own."""

    def __init__(
        self,
        backend: Backend,
        agreement: RankAgreement,
        fusion: ProjectionFusion | None = None,
        compile_cache: CompileCache | None = None,
        keep_across_sleep: bool = True,
        weights: WeightsMode = "auto",
    ):
        self.backend = backend
        #: whether what is held lives in a memory region of the backend (when it offers one),
        #: so a sleep gives the memory back and keeps the graphs
        self.keep_across_sleep = keep_across_sleep
        #: the tensors the graphs read in place of the model's (:mod:`.weights`)
        self.weights = HeldWeights(backend, weights)
        self.agreement = agreement
        #: where compiled captures keep their compiled code between processes
        self.compile_cache = compile_cache or CompileCache(None)
        #: the engine's joined projections, which compiled captures route through the backend's
        #: one-row product with the model's other projections
        self.fusion = fusion
        self._held: Held | None = None
        self._captures = 0
        #: why graphs are off for this engine (a failed capture here or on another rank)
        self.disabled_reason: str | None = None
        #: the sampler's shape: it grows per engine, so alternating greedy and sampled calls
        #: replay one graph (docs/rollout-mechanism.md, "Sampler shapes"), except truncation,
        #: which is the current call's own (its graphs are this shape's)
        self.sampler = SamplerShape()
        #: the model's host state when this engine last compiled (see :meth:`_compiled`)
        self.compiled_state: object | None = None

    def held_step(self) -> DecodeStep | None:
        """The decode step held (its cache, masks and state), ``None`` when nothing is."""
        return None if self._held is None else self._held.step

    def capture_count(self) -> int:
        """Every graph this holder has captured, on every path and call."""
        return self._captures

    def sampler_for(self, rows: Sequence[SamplingParams]) -> SamplerShape:
        """The narrowest sampler shape on the engine's buffers that serves this call (its
        per-row settings ``rows``): what every earlier call grew, and the call's own
        truncation. The call's graphs and steps are this shape's from now on."""
        fused = self.backend.truncated_draw() is not None
        self.sampler = self.sampler.widen(rows, fused)
        if self._held is not None:
            self._held.step.sampler = self.sampler
        return self.sampler

    def release_stale(self, signature: GraphSignature) -> list[str]:
        """Drop what was held for another signature; the names of the members that changed."""
        if self._held is None or self._held.signature == signature:
            return []
        changed = self._held.signature.differences(signature)
        self.drop()
        return changed

    def step_for(
        self,
        signature: GraphSignature,
        specs: tuple[LayerSpec, ...],
        build: Callable[[KVMemory], DecodeStep],
    ) -> DecodeStep:
        """The held step for ``signature``, or a new one from ``build`` (sized from ``specs``,
        the K/V shapes the prefill produced), allocated in a memory region of the backend where
        it offers one (``build`` allocates the K/V buffers within the context it is handed)."""
        if self._held is not None and self._held.step.cache.layer_specs() != specs:
            self.drop()
        if self._held is None:
            region = self.backend.memory_region() if self.keep_across_sleep else None
            if region is None:
                step = build(contextlib.nullcontext)
            else:
                with region.allocating(keep=True):
                    step = build(functools.partial(region.allocating, keep=False))
            self._held = Held(signature, step, region=region)
        self._held.step.sampler = self.sampler
        return self._held.step

    @property
    def asleep(self) -> bool:
        """Whether the held memory is released (:meth:`sleep`) and not mapped again yet."""
        return (
            self._held is not None
            and self._held.region is not None
            and (self._held.region.released)
        )

    def sleep(self) -> SleepReport | None:
        """Give the held memory back to the device: released in place where it lives in a
        region (the graphs stay and replay after :meth:`wake`), else dropped with the graphs.
        What it gave back, or ``None`` when nothing was held (or it was asleep already)."""
        held = self._held
        if held is None:
            self.weights.clear()  # storage adopted for graphs that are gone
            return None
        if held.region is not None and held.region.released:
            return None
        start = time.perf_counter()
        self.backend.synchronize()  # no queued replay may still use the memory
        self.backend.empty_cache()  # what was free already is not counted as given back
        before = self.backend.free_memory()
        if held.region is None:
            size = held.step.cache.nbytes()
            self.weights.clear()
            self.drop()
        else:
            size = self.region_bytes()
            held.region.release()
            self.weights.release()
            self.backend.empty_cache()
        self.backend.synchronize()
        return SleepReport(
            kept_graphs=held.region is not None,
            held_bytes=size,
            free_before=before,
            free_after=self.backend.free_memory(),
            still_held_bytes=self.weights.adopted_bytes(),
            seconds=time.perf_counter() - start,
        )

    def wake(self) -> float | None:
        """Map released memory again (its K/V buffers zeroed, as freshly allocated ones are);
        the seconds it took, or ``None`` when nothing was asleep."""
        if not self.asleep:
            return None
        start = time.perf_counter()
        need, free = self.region_bytes(), self.backend.free_memory()
        if free is not None and need > free:  # only then, or the trainer's cache regrows each step
            self.backend.empty_cache()  # the trainer's cached blocks
            free = self.backend.free_memory()
        if free is not None and free < need:
            raise WakeMemoryError(
                f"waking the engine maps {need / 2**30:.2f} GiB again but only "
                f"{free / 2**30:.2f} GiB of {self.backend.device_name()} is free: the trainer "
                "still holds the memory the sleep gave it. The engine stays asleep: free that "
                "memory (optimizer.zero_grad(set_to_none=True), offloaded optimizer states) "
                "and call again"
            )
        self._held.region.restore()
        self.weights.restore()
        self._held.step.cache.clear()
        return time.perf_counter() - start

    def region_bytes(self) -> int:
        """Bytes of the held memory region (what a sleep gives back); 0 without one."""
        held = self._held
        mine = 0 if held is None or held.region is None else held.region.nbytes()
        return mine + self.weights.nbytes()

    def held_bytes(self) -> int:
        """Bytes of the K/V cache held for the last signature: a new call reuses or releases
        them, so they count as available to it."""
        return 0 if self._held is None else self._held.step.cache.nbytes()

    def graph(self, key: GraphKey = FULL_STEP) -> object | None:
        """The call's sampler shape's graph ``key``, ``None`` when not captured."""
        return None if self._held is None else self._held.graphs.get((self.sampler, key))

    @property
    def graph_count(self) -> int:
        """Graphs held for the call's sampler shape."""
        held = () if self._held is None else self._held.graphs
        return sum(shape == self.sampler for shape, _ in held)

    def capture_reason(self, key: GraphKey = FULL_STEP) -> str:
        """Why graph ``key`` of the call's sampler shape is missing (and so captured)."""
        held = {} if self._held is None else self._held.graphs
        if not held:
            return "no graph held (a new signature: see recapture_reason)"
        if not any(shape == self.sampler for shape, _ in held):
            return f"sampler shape first met ({self.sampler.describe()})"
        return key.describe()

    def agree(self, use_graph: bool, capture: bool) -> GraphVerdict:
        """The process group's graph decision for this call (local without a group): use graphs
        when ``use_graph`` and no ``eager_reason``. A rank recapturing makes every rank
        recapture (the graphs are dropped here)."""
        verdict = self.agreement.decide(use_graph, capture)
        if verdict.eager_reason is None and verdict.recapture:
            self.drop_graphs()
        return verdict

    def capture(
        self,
        step: DecodeStep,
        attention: str,
        key: GraphKey = FULL_STEP,
        compiled: bool = False,
    ) -> CaptureOutcome:
        """Capture ``step`` as graph ``key`` and agree on the outcome with the group; the
        outcome's graph is ``None`` when this or another rank's capture failed (graphs then stay
        off for this engine, :attr:`disabled_reason` the outcome's reason).

        ``attention``: the implementation the captured step runs (the model's own is restored
        after capture, so eager steps never see it). ``compiled``: the warm-up and capture run
        the model's blocks around attention compiled (:mod:`graphcap.rollout.plan.regions`; the
        warm-up compiles them, with the compile cache's file for this shape loaded).
        """
        assert self._held is not None, "step_for() comes first"
        start = time.perf_counter()
        region, pool, memory = self._held.region, None, contextlib.nullcontext
        if region is not None:  # the graphs' memory sleeps with the rest
            pool = region.graph_pool()
            # a compiled step's graph keeps its memory's contents across a sleep: measured on
            # an H100, its replays after a wake differed from an engine's that never slept
            memory = functools.partial(region.capturing, keep=compiled)
        elif key != FULL_STEP or self._held.graphs:  # a set of graphs shares one pool
            pool = self._held.pool = self._held.pool or self.backend.graph_pool_handle()
        cache, warmup_s = None, 0.0
        try:
            with _attention(step.model, attention), self._compiled(step, compiled) as cache:
                graph, warmup_s = timed_capture(self.backend, step, pool, memory)
        except Exception as exc:  # any capture failure: rolled back; the call goes on eagerly
            if isinstance(exc, CaptureFailed):
                exc, warmup_s = exc.__cause__, exc.warmup_s
            self.disabled_reason = fallback_reason(exc)
            self.agreement.peer_capture_failure(captured=False)
            self.drop_graphs()
            return self._outcome(None, start, warmup_s, cache)
        self._captures += 1
        peer_failure = self.agreement.peer_capture_failure(captured=True)
        if peer_failure is not None:
            self.disabled_reason = peer_failure
            self.drop_graphs()
            return self._outcome(None, start, warmup_s, cache)
        self._held.graphs[self.sampler, key] = graph
        return self._outcome(graph, start, warmup_s, cache)

    def _outcome(
        self, graph: object | None, start: float, warmup_s: float, cache: str | None
    ) -> CaptureOutcome:
        reason = None if graph is not None else self.disabled_reason
        return CaptureOutcome(graph, time.perf_counter() - start, warmup_s, reason, cache)

    @contextlib.contextmanager
    def _compiled(self, step: DecodeStep, compiled: bool) -> Iterator[str | None]:
        """Compiled captures: :func:`compiled_regions` and :func:`compiled_bookkeeping`, with the
        projections through the backend's one-row product where it offers one, under the
        backend's compiled-capture settings, with the compile cache's file for this shape.
        Yields what the compile cache did (``None`` for an uncompiled capture)."""
        product = self.backend.one_row_product() if compiled else None
        cache = None
        with contextlib.ExitStack() as stack:
            if compiled:
                state = self._held.signature.host_state
                if self.compiled_state is not None and self.compiled_state != state:
                    # dynamo does not guard on every host value the signature does (a module's
                    # forward hooks): code compiled before the change must not be captured
                    torch.compiler.reset()
                self.compiled_state = state
                options = self.backend.compile_options()
                key = self._cache_key(step, options)
                cache = stack.enter_context(self.compile_cache.session(key)).state
                stack.enter_context(self.backend.compiled_capture_context())
                stack.enter_context(compiled_regions(step.model, step.cache, options))
                stack.enter_context(compiled_bookkeeping(step, options))
            if product is not None:
                stack.enter_context(one_row_products(step.model, product, self.fusion))
            yield cache

    def _cache_key(self, step: DecodeStep, options: dict[str, object]) -> str:
        """The compile-cache file of this step's shape on this backend."""
        batch, length = step.state.sequences.shape
        description = {
            "batch": batch,
            "length": length,
            "dtype": next(step.model.parameters()).dtype,
            "backend": self.backend.name,
            "device": self.backend.device_name(),
            "options": options,
            "one_row": self.backend.one_row_product() is not None,
            "joined_groups": len(self.fusion.active) if self.fusion is not None else 0,
            "sampler": self.sampler.describe(),  # each shape compiles its own finish step
        }
        return shape_key(step.model, description)

    def drop_graphs(self) -> None:
        """Forget the graphs (and their pool); the buffers stay."""
        if self._held is not None and self._held.graphs:
            self._held.graphs.clear()
            self._held.pool = None
            self.backend.empty_cache()

    def drop(self) -> bool:
        """Release the graphs and every buffer of the held signature; whether anything was
        held."""
        held, self._held = self._held, None
        if held is not None:
            held.graphs.clear()
            held.step.cache.release()
            if held.region is not None:
                held.region.close()
            self.backend.empty_cache()
        return held is not None


@contextlib.contextmanager
def _attention(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run with attention implementation ``name``, then restore the model's own."""
    own = attention_implementation(model)
    if name == own:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(own)
