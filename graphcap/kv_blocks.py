"""Block KV tables: what a block-aware attention kernel reads during a decode step.

The engine can keep each layer's K/V in a pool of fixed-size blocks instead of one
``(batch, heads, max_len, head_dim)`` buffer per layer: row ``b``'s logical cache column ``c``
lives in block ``table[b, c // block_size]`` at offset ``c % block_size``. Blocks are handed out
as rows grow and returned when a slot retires, so the memory held follows the tokens written,
not the batch size times the longest request. Growth happens between graph replays (a write
into ``table`` on the device, or a new capture when the pool itself must grow), never inside a
captured region.

An attention function that reads the pool through the table marks itself with
:func:`reads_kv_blocks`. While the engine runs a decode forward with such a function selected,
:func:`current` returns the :class:`BlockView` of that step and each cache layer hands the
attention function its *pools* as ``key`` / ``value``, shaped
``(num_blocks, kv_heads, block_size, head_dim)``, instead of a ``(batch, kv_heads, max_len,
head_dim)`` gather of them. The attention mask keeps its usual ``(batch, 1, q, max_len)`` form
over the logical columns (``max_len = blocks_per_row * block_size``). Any other attention
function sees ordinary contiguous K/V, so every model and kernel works on a block table.

This module is core: plugins import it to read the view; it names no device library.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

import torch

#: Block id that unassigned table entries point at: a block of zeros that no row writes.
NULL_BLOCK = 0


@dataclass(frozen=True)
class BlockView:
    """The block table of one decode step, as device tensors the step updates itself.

    ``table``: ``(batch, blocks_per_row)`` int32, block ids per row (``NULL_BLOCK`` where none
    is assigned). ``lengths``: ``(batch,)`` int32, row ``b`` holds K/V in its logical columns
    ``[0, lengths[b])`` (left padding included; the mask closes it). Both live on the device and
    change between replays, so a kernel must read them there, never as host values.
    """

    table: torch.Tensor
    lengths: torch.Tensor
    block_size: int

    @property
    def max_len(self) -> int:
        return int(self.table.shape[1]) * self.block_size


_CURRENT: ContextVar[BlockView | None] = ContextVar("graphcap_kv_blocks", default=None)


def current() -> BlockView | None:
    """The block view of the decode forward in progress, or ``None`` (contiguous K/V)."""
    return _CURRENT.get()


@contextlib.contextmanager
def reading_blocks(view: BlockView) -> Iterator[None]:
    """Within the block, block-aware attention functions read ``view`` (set by the engine).
    Set inside the ``try``, so no interrupt can leave it set after the block."""
    outer = _CURRENT.get()
    try:
        _CURRENT.set(view)
        yield
    finally:
        _CURRENT.set(outer)


F = TypeVar("F", bound=Callable[..., object])


def reads_kv_blocks(function: F) -> F:
    """Mark an attention function as one that reads pools through :func:`current`'s table."""
    function.reads_kv_blocks = True  # type: ignore[attr-defined]
    return function


def is_block_aware(function: object) -> bool:
    """Whether ``function`` was marked with :func:`reads_kv_blocks`."""
    return bool(getattr(function, "reads_kv_blocks", False))


def gather(pool: torch.Tensor, view: BlockView) -> torch.Tensor:
    """Row-contiguous K or V, ``(batch, kv_heads, max_len, head_dim)``, read from ``pool``
    through ``view.table``: what an attention function that is not block-aware is handed (a
    copy of every row's logical columns, one gather; null blocks read as zeros)."""
    batch, blocks = view.table.shape
    picked = pool.index_select(0, view.table.reshape(-1).to(torch.long))
    picked = picked.view(batch, blocks, *pool.shape[1:]).transpose(1, 2)
    return picked.reshape(batch, pool.shape[1], blocks * view.block_size, pool.shape[-1])
