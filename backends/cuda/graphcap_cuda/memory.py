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

It is an optional dependency (``pip install ./backends/cuda[sleep]``); without it the backend
offers no region and engines free their memory at a sleep and capture again after it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from graphcap.backend import MemoryRegion

_REGIONS = itertools.count()


def memory_saver() -> Any | None:
    """torch_memory_saver's process-wide saver in its in-process (``"torch"``) hook mode, or
    ``None`` where the library is not installed or cannot load here."""
    try:
        import torch_memory_saver
    except ImportError:
        return None
    saver = torch_memory_saver.torch_memory_saver
    # initialised earlier (by graphcap or by its user): its mode is kept
    with contextlib.suppress(AssertionError):
        saver.hook_mode = "torch"
    return saver


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
        self._released = False
        self._bytes = 0

    @contextlib.contextmanager
    def allocating(self, keep: bool) -> Iterator[None]:
        if self._released:
            raise RuntimeError("allocation in a released memory region; restore() it first")
        with self._counted(), self._saver.region(tag=self._tags[keep], enable_cpu_backup=keep):
            yield

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Captures run here: their allocations go to the graph pool's tag."""
        with self._counted(), self._saver.region(tag=self._graph_tag):
            yield

    def graph_pool(self) -> Any:
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.MemPool(allocator=_graph_pool_allocator())
        return self._graph_pool.id

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """Adds the memory torch reserves inside the block to :meth:`nbytes` (new segments,
        which the region's allocator maps)."""
        before = torch.cuda.memory_reserved()
        try:
            yield
        finally:
            self._bytes += max(0, torch.cuda.memory_reserved() - before)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            return
        torch.cuda.synchronize()
        for tag in (self._graph_tag, *self._tags.values()):
            self._saver.pause(tag)
        self._released = True

    def restore(self) -> None:
        if not self._released:
            return
        for tag in (*self._tags.values(), self._graph_tag):
            self._saver.resume(tag)
        torch.cuda.synchronize()
        self._released = False

    def nbytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        self.restore()
        self._graph_pool = None
