"""The weights captured graphs read: the model's own tensors, or tensors the engine holds.

A graph replays on the addresses its capture saw. A trainer's in-place updates (optimizer
steps, ``load_weights_in_place``) keep those addresses, so the graphs read the model's own
tensors and nothing is copied. A trainer that gives a parameter new storage (ZeRO-3's gather
for generation, ``load_state_dict(assign=True)``, ``param.data = ...``) would free the storage
the graphs read; instead of capturing again, the engine keeps tensors of its own at the
captured addresses and copies the new values into them at the start of each call (one device
copy a tensor), pointing the parameters at them for the call only:

* ``"model"``: the graphs read the model's tensors; a tensor that moves is *adopted*: the engine
  keeps its old storage (a reference, so the trainer's free does not return it) and copies the
  new values there. Adopted storage lives outside the engine's memory region and stays held
  across a sleep.
* ``"copy"``: the engine keeps its own copy of every parameter and buffer in a memory region of
  the backend (released at a sleep with the rest) and copies the model's values into it at each
  call: for models whose storage is not stable from round to round.
* ``"auto"``: ``"copy"`` for models whose storage a sharding library replaces every round
  (DeepSpeed ZeRO-3 parameters, FSDP2), else ``"model"``.

Sharded trainers (docs/trainers.md, "Sharded trainers"): a ZeRO-3 gather around ``generate``
gives every parameter new storage for the call and releases it after; FSDP2 is unsharded here
for the call (:mod:`graphcap.rollout.holder.fsdp`) and resharded after. Either way the graphs
read the engine's copy, filled by one copy a tensor per call, and released at a sleep with the
rest of the engine's memory, so between rounds the trainer holds only its shards. FSDP2 frees
and reallocates its unsharded storage in place (same tensors, new addresses), which no
reference can keep: it is served from the copy whatever the mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from graphcap.backend import Backend, MemoryRegion
from graphcap.rollout.holder.fsdp import unsharded
from graphcap.rollout.plan.scan import FSDP2

WeightsMode = Literal["auto", "model", "copy"]


@dataclass(frozen=True)
class Served:
    """How one call's weights were served: ``kind`` is ``"model"`` (the model's own tensors),
    ``"adopted"`` (some moved and the engine holds the storage its graphs read) or ``"copy"``
    (the engine's own copy); ``copied`` tensors were copied for the call."""

    kind: str
    copied: int


class HeldWeights:
    """The tensors the engine's graphs read for each parameter and buffer of the model."""

    def __init__(self, backend: Backend, mode: WeightsMode):
        self.backend, self.mode = backend, mode
        self._held: dict[str, torch.Tensor] = {}
        self._adopted: set[str] = set()
        self._region: MemoryRegion | None = None

    def _copying(self, sharded: str | None) -> bool:
        if sharded == FSDP2:
            return True
        return self.mode == "copy" or (self.mode == "auto" and sharded is not None)

    @contextlib.contextmanager
    def serving(self, model: torch.nn.Module, sharded: str | None) -> Iterator[Served]:
        """Within the block the model's parameters and buffers are the tensors the graphs
        read, holding the model's current values (FSDP2 unsharded first); the model's own
        afterwards. ``sharded``: the library sharding the model
        (:attr:`~graphcap.rollout.plan.scan.ModelScan.sharded`)."""
        copying = self._copying(sharded)
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        copied = 0
        with contextlib.ExitStack() as stack:
            stack.enter_context(unsharded(model))
            stack.callback(_restore, swapped)
            with torch.no_grad():
                for name, tensor in _resident_tensors(model):
                    held = self._held.get(name)
                    if held is None or not _same_kind(held, tensor):
                        held = self._held[name] = self._new(tensor, copying)
                        self._adopted.discard(name)
                    if held.data_ptr() == tensor.data_ptr():
                        continue
                    if not copying:
                        self._adopted.add(name)
                    held.copy_(tensor)
                    copied += 1
                    swapped.append((tensor, tensor.data))
                    tensor.data = held
            kind = "copy" if copying else "adopted" if self._adopted else "model"
            yield Served(kind, copied)

    def _new(self, tensor: torch.Tensor, copying: bool) -> torch.Tensor:
        """What the graphs read for ``tensor`` from now on: a reference to its storage, or a
        tensor of the engine's memory region (the device's memory where it has none)."""
        if not copying:
            return tensor.detach()
        if self._region is None:
            self._region = self.backend.memory_region()
        if self._region is None:
            return torch.empty_like(tensor)
        with self._region.allocating(keep=False):  # refilled at every call
            return torch.empty_like(tensor)

    def release(self) -> None:
        """Give the engine's own copy back with the rest of its memory (a sleep)."""
        if self._region is not None and not self._region.released:
            self._region.release()

    def restore(self) -> None:
        if self._region is not None and self._region.released:
            self._region.restore()

    def nbytes(self) -> int:
        """Bytes of the engine's own copy (0 when the graphs read the model's tensors)."""
        return 0 if self._region is None else self._region.nbytes()

    def adopted_bytes(self) -> int:
        """Bytes of moved-away storage the engine holds because its graphs read it."""
        return sum(self._held[n].untyped_storage().nbytes() for n in self._adopted)

    def clear(self) -> None:
        """Forget every held tensor (the graphs reading them were dropped)."""
        self._held.clear()
        self._adopted.clear()
        if self._region is not None:
            self._region.close()
            self._region = None


def _restore(swapped: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Point each swapped tensor back at its own storage."""
    for tensor, own in reversed(swapped):
        tensor.data = own


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)


def _resident_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer once (tied ones under their first name), except tensors
    that hold no data of their own here (meta, zero-size placeholders, DTensor shards)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta or tensor.numel() == 0 or type(tensor.data) is not torch.Tensor:
            continue
        yield name, tensor
