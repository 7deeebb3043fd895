"""Memory regions on CUDA: released at a sleep and mapped again at the same addresses.

torch_memory_saver (the library SGLang, verl and slime use for the same job) does the hard
part: its allocator reserves virtual addresses and maps physical memory under them with
CUDA's virtual memory API, so ``pause`` unmaps the physical memory of every allocation of a
tag (saving it to host memory first where the tag asks for a backup) and ``resume`` maps new
memory at the same addresses. graphcap routes an engine's allocations to it through torch's
pluggable-allocator pools (its ``"torch"`` hook mode: no ``LD_PRELOAD``):

* the decode buffers under a tag with a host backup (their contents survive);
* the K/V cache under a tag without one (a call writes every column it reads);
* the graphs' private pool, a ``MemPool`` on the same allocator used by captures only, under a
  third tag: a block the allocator hands to a graph must never go to an ordinary tensor.

torch_memory_saver's in-process allocator refuses (it aborts the process) to free memory
outside one of its regions, so no pool of a region is ever let go: a closed region's memory is
released, its pools kept (:data:`_POOLS`, torch_memory_saver's own per-tag pools likewise).

Memory the whole process shares must never land in a region: one engine's sleep would unmap it
under every other user. The default CUDA generator's graph-safe state is such memory: torch
allocates its seed and offset tensors when the first graph registers the generator (every
capture does, at its start) and frees them when the last graph goes. Made inside the first
engine's capture, they lived in its region, and a second engine's graphs (a drop-in beside a
never-sleeping reference, on an H100) hit an illegal memory access once the first slept. So a
capture in a region first registers the generator with a graph the process keeps
(:func:`generator_state_outside_regions`), outside every region.

It is an optional dependency (``pip install ./backends/cuda[sleep]``); without it the backend
offers no region and engines free their memory at a sleep and capture again after it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from graphcap.backend import MemoryRegion

_REGIONS = itertools.count()


def _release(saver: Any, tags: tuple[str, ...], state: dict[str, bool]) -> None:
    """Unmap the physical memory of every allocation of ``tags`` (addresses stay reserved),
    unless ``state`` says it is released already (torch_memory_saver aborts on a second pause)."""
    if state["released"]:
        return
    torch.cuda.synchronize()
    for tag in tags:
        saver.pause(tag)
    state["released"] = True


#: Every graph pool a region made, kept for the life of the process: torch's allocator frees
#: a pool's segments once nothing holds it, and torch_memory_saver's allocator aborts the
#: process on a free outside one of its regions (the caller's own ``empty_cache``, or the
#: pool's end when its region is collected). A region's memory is released instead.
_POOLS: list[torch.cuda.MemPool] = []


@functools.cache
def memory_saver() -> Any | None:
    """torch_memory_saver's process-wide saver in its in-process (``"torch"``) hook mode, or
    ``None`` where the library is not installed. Its mode is set once, before the saver's first
    use; a saver its user configured before keeps that user's mode."""
    try:
        import torch_memory_saver
    except ImportError:
        return None
    saver = torch_memory_saver.torch_memory_saver
    with contextlib.suppress(AssertionError, AttributeError):  # configured already
        saver.hook_mode = "torch"
    return saver


@atexit.register
def _frees_allowed_at_exit() -> None:
    """From here to the process's end every free reaches torch_memory_saver's allocator as if
    inside one of its regions: the pools that go in the interpreter's teardown would otherwise
    abort the process (it refuses frees outside its regions). The library has no public switch
    for it, so this sets its flag through its loaded binary (private, at exit only)."""
    saver = memory_saver() if memory_saver.cache_info().currsize else None
    binary = getattr(getattr(saver, "_impl", None), "_binary_wrapper", None)
    if binary is not None:
        binary.cdll.tms_set_interesting_region(True)


@functools.cache
def generator_state_outside_regions(device: int) -> torch.cuda.CUDAGraph:
    """Register ``device``'s default generator with a graph kept for the process, so its
    graph-safe state (seed and offset tensors, made at the first registration, freed at the
    last graph's end) is allocated here, outside every region, and stays."""
    keeper = torch.cuda.CUDAGraph()
    keeper.register_generator_state(torch.cuda.default_generators[device])
    return keeper


def _graph_pool_allocator() -> Any:
    """torch_memory_saver's allocator, for a pool of graph memory only."""
    from torch_memory_saver.hooks.mode_torch import HookUtilModeTorch

    return HookUtilModeTorch().get_allocator()


class SleepableRegion(MemoryRegion):
    """A :class:`~graphcap.backend.MemoryRegion` on torch_memory_saver (see the module)."""

    def __init__(self, saver: Any) -> None:
        n = next(_REGIONS)
        self._saver = saver
        self._tags = {True: f"graphcap-{n}-kept", False: f"graphcap-{n}-kv"}
        self._graph_tag = f"graphcap-{n}-graphs"
        self._graph_pool: torch.cuda.MemPool | None = None
        self._state = {"released": False}
        self._bytes = 0
        self._nested: list[int] = []  # bytes counted inside each open block, innermost last
        #: a region collected without close() gives its memory back all the same
        self._finalizer = weakref.finalize(self, _release, saver, self._all_tags(), self._state)

    def _all_tags(self) -> tuple[str, ...]:
        return (self._graph_tag, *self._tags.values())

    @contextlib.contextmanager
    def allocating(self, keep: bool) -> Iterator[None]:
        if self.released:
            raise RuntimeError("allocation in a released memory region; restore() it first")
        with self._counted(), self._saver.region(tag=self._tags[keep], enable_cpu_backup=keep):
            yield

    @contextlib.contextmanager
    def capturing(self, keep: bool = False) -> Iterator[None]:
        """Captures run here: their allocations go to the graph pool's tag (and none of the
        process's shared state: see the module)."""
        generator_state_outside_regions(torch.cuda.current_device())
        with self._counted(), self._saver.region(tag=self._graph_tag, enable_cpu_backup=keep):
            yield

    def graph_pool(self) -> Any:
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.MemPool(allocator=_graph_pool_allocator())
            _POOLS.append(self._graph_pool)
        return self._graph_pool.id

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """Adds the memory torch reserves inside the block to :meth:`nbytes` (new segments,
        which the region's allocator maps), once: a block nested in another (the K/V buffers
        inside a step's build) is not counted again by the outer one."""
        before = torch.cuda.memory_reserved()
        self._nested.append(0)
        try:
            yield
        finally:
            inner = self._nested.pop()
            grown = max(0, torch.cuda.memory_reserved() - before)
            self._bytes += grown - inner
            if self._nested:
                self._nested[-1] += grown

    @property
    def released(self) -> bool:
        return self._state["released"]

    def release(self) -> None:
        _release(self._saver, self._all_tags(), self._state)

    def restore(self) -> None:
        if not self.released:
            return
        for tag in (*self._tags.values(), self._graph_tag):
            self._saver.resume(tag)
        torch.cuda.synchronize()
        self._state["released"] = False

    def nbytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        """The region's memory goes back to the device for good: its tags stay released (its
        tensors and graphs are gone, nothing reads them again) and its pools stay alive, so no
        free ever reaches torch_memory_saver's allocator (see :data:`_POOLS`)."""
        self.release()
        self._finalizer.detach()
