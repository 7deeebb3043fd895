"""A memory region on the CPU with a device's release-and-map-again semantics.

What an accelerator's sleep does (vLLM's CuMem allocator, torch_memory_saver) is modelled here
so that every engine test on the CPU reference backend exercises it:

* tensors allocated inside :meth:`ReferenceRegion.allocating` (and those a capture allocates
  there) belong to the region for as long as they live, as blocks of a device pool do;
* :meth:`~ReferenceRegion.release` gives the pages back to the host kernel (``madvise``
  ``MADV_DONTNEED`` on Linux, so ``MemAvailable`` rises) while every address stays where it was,
  and saves the contents of ``keep`` allocations first;
* a graph replay that touches released memory raises (a device has nothing mapped there);
* :meth:`~ReferenceRegion.restore` maps the pages again at the same addresses and poisons them
  (NaN, 0xA5 bytes), as fresh device memory holds no computed values; ``keep`` contents are
  copied back. Code that relied on a buffer surviving a sleep it does not keep shows up as
  wrong tokens.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from graphcap.backend import MemoryRegion
from graphcap.cpu.graph import RELEASED_STORAGES, poison_storage, tensors_in
from graphcap.cpu.torch_internals import TorchDispatchMode, storage_key

_MADV_DONTNEED = 4  # Linux's value (asm-generic/mman-common.h)


def _libc_madvise():  # type: ignore[no-untyped-def]
    """libc's ``madvise``, or ``None`` where there is none to call (then contents are only
    poisoned, and no memory returns to the host)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        madvise = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _libc_madvise()


def _give_back(storage: torch.UntypedStorage) -> None:
    """Return the whole pages inside ``storage`` to the host (contents then read as zeros)."""
    page = mmap.PAGESIZE
    start = storage.data_ptr()
    first = -(-start // page) * page
    last = (start + storage.nbytes()) // page * page
    if _MADVISE is not None and last > first:
        _MADVISE(first, last - first, _MADV_DONTNEED)


@dataclass
class _Entry:
    storage: weakref.ref[torch.UntypedStorage]
    dtype: torch.dtype
    keep: bool
    saved: torch.UntypedStorage | None = None


class _Tracker(TorchDispatchMode):
    """Adds the storage of every tensor an operation creates to the region, with the ``keep``
    of the innermost :meth:`ReferenceRegion.allocating` block (as a device's allocator routes
    an allocation to the innermost pool)."""

    def __init__(self, region: ReferenceRegion) -> None:
        super().__init__()
        self.region = region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        result = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in tensors_in((args, kwargs))}
        keep = self.region.scopes[-1]
        for tensor in tensors_in(result):
            if tensor.layout == torch.strided and storage_key(tensor) not in inputs:
                self.region.adopt(tensor, keep)
        return result


class ReferenceRegion(MemoryRegion):
    """The CPU reference backend's :class:`~graphcap.backend.MemoryRegion`."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._released = False
        #: the ``keep`` of each :meth:`allocating` block open, innermost last
        self.scopes: list[bool] = []

    @contextlib.contextmanager
    def allocating(self, keep: bool) -> Iterator[None]:
        if self._released:
            raise RuntimeError("allocation in a released memory region; restore() it first")
        tracking = contextlib.nullcontext() if self.scopes else _Tracker(self)
        self.scopes.append(keep)
        try:
            with tracking:
                yield
        finally:
            self.scopes.pop()

    def adopt(self, tensor: torch.Tensor, keep: bool) -> None:
        """Make ``tensor``'s storage part of the region (the first owner's ``keep`` wins)."""
        storage = tensor.untyped_storage()
        key = storage_key(tensor)
        if storage.nbytes() and key not in self._entries:
            self._entries[key] = _Entry(weakref.ref(storage), tensor.dtype, keep)

    def _live(self) -> Iterator[tuple[int, _Entry, torch.UntypedStorage]]:
        """The entries whose storage is still alive (a freed one leaves the region)."""
        for key, entry in list(self._entries.items()):
            storage = entry.storage()
            if storage is None:
                del self._entries[key]
            else:
                yield key, entry, storage

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            return
        for key, entry, storage in self._live():
            if entry.keep:
                entry.saved = storage.clone()
            poison_storage(storage, entry.dtype)  # the edges madvise cannot drop
            _give_back(storage)
            RELEASED_STORAGES[key] = entry.storage
        self._released = True

    def restore(self) -> None:
        if not self._released:
            return
        for key in self._entries:
            RELEASED_STORAGES.pop(key, None)
        for _key, entry, storage in self._live():
            poison_storage(storage, entry.dtype)
            if entry.saved is not None:
                storage.copy_(entry.saved)
                entry.saved = None
        self._released = False

    def nbytes(self) -> int:
        return sum(storage.nbytes() for _key, _entry, storage in self._live())

    def close(self) -> None:
        if self._released:
            self.restore()
        self._entries.clear()
