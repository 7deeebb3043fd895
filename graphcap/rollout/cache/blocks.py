"""The block KV table: per-layer pools of fixed-size blocks, one device table, a host allocator.

Row ``b``'s logical column ``c`` lives in ``pool[table[b, c // block_size], :, c % block_size]``
(:mod:`graphcap.kv_blocks` is the contract kernels read). The decode step writes through the
table with device index math only, so it captures; the table's entries and the allocator are
the host's, changed between replays only: the host knows each row's write column without a
device read (the static path's width plus steps, the continuous path's ``SlotTable.column``) and
hands blocks out ahead (:meth:`BlockKVCache.assign`). When the free list runs dry the pools grow:
new tensors, so the graph that read the old ones is dropped first and the step recaptured (a pool
of :func:`whole_table_blocks`, as the static path sizes its own, never runs dry).

Block 0 is the null block (zeros, never written) that unassigned entries point at; block 1 is the
shared *sink* block: an idle row's table points its first entry there, it writes its step's K/V
at column 0 and reads one column (``lengths`` 1), so an idle slot costs one block for all of them
instead of a sink column at the end of a row it would read in full.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from graphcap import kv_blocks
from graphcap.rollout.cache.cache import (
    KVMemory,
    LayerSpec,
    PreallocatedCache,
    PreallocatedLayer,
    PrefillWriter,
    put_columns,
)

#: The block idle rows write and read (one for every idle row; its contents are never used).
SINK_BLOCK = 1
_RESERVED = 2  # the null block and the sink block


@dataclass(frozen=True)
class Holdings:
    """The allocator's host side: ``free`` block ids (the last is handed out first), the
    blocks each row holds (``owned``, in table order), the pools' growths so far and the most
    blocks held at once since the last reset. Replaced whole, by one assignment, so an
    exception (an interrupt included) never leaves half of it changed."""

    free: tuple[int, ...]
    owned: tuple[tuple[int, ...], ...]
    growths: int = 0
    peak_held: int = 0

    @property
    def held(self) -> int:
        return sum(len(blocks) for blocks in self.owned)


def reads_blocks(attention: str) -> bool:
    """Whether the registered attention implementation ``attention`` reads pools through the
    table (:func:`graphcap.kv_blocks.reads_kv_blocks`) instead of a gathered contiguous K/V."""
    # loaded here, not at import: it costs seconds, and the model's own module has loaded it
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    function = ALL_ATTENTION_FUNCTIONS.get(attention) if attention != "eager" else None
    return kv_blocks.is_block_aware(function)


def rounded_length(total_len: int, block_size: int) -> int:
    """``total_len`` rounded up to whole blocks (the logical row length of a block table)."""
    return -(-total_len // block_size) * block_size


def whole_table_blocks(batch_size: int, max_len: int, block_size: int) -> int:
    """Blocks in a pool that holds every row's whole table, plus the null and sink blocks: the
    most a ``batch_size`` x ``max_len`` table can ever hand out, so such a pool never grows."""
    return batch_size * (max_len // block_size) + _RESERVED


def full_pool_columns(batch_size: int, total_len: int, block_size: int) -> int:
    """Columns each layer's pools hold once every row's whole table is handed out (where growth
    stops): the block layout's K/V for a call whose rows all run to ``total_len``, in whole
    blocks, the null and sink blocks included."""
    rounded = rounded_length(total_len, block_size)
    return whole_table_blocks(batch_size, rounded, block_size) * block_size


class BlockKVLayer(PreallocatedLayer):
    """One layer: ``keys``/``values`` pools ``(num_blocks, H, block_size, D)`` read through the
    cache's shared table."""

    def __init__(self, spec: LayerSpec, cache: BlockKVCache, num_blocks: int):
        super().__init__(spec, num_blocks, cache.block_size, put_columns, cache.memory)
        self.cache = cache

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``q`` new columns per row at ``write_pos[b] + i`` through the table; return the
        pools to a block-aware attention (:func:`kv_blocks.current` set), else a gather."""
        cache = self.cache
        columns = cache.write_pos[:, None]
        if key_states.shape[2] > 1:
            columns = columns + torch.arange(key_states.shape[2], device=columns.device)
        blocks = cache.table.gather(1, columns // cache.block_size).to(torch.long)
        index = (blocks[:, None, :], self.heads, (columns % cache.block_size)[:, None, :])
        self.put(self.keys, self.values, index, key_states, value_states)
        if kv_blocks.current() is not None:
            return self.keys, self.values
        view = cache.view
        return kv_blocks.gather(self.keys, view), kv_blocks.gather(self.values, view)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.max_len, 0

    def get_seq_length(self) -> torch.Tensor:  # type: ignore[override]
        """The furthest write position, as a device tensor (a host int would force a sync)."""
        return self.cache.write_pos.max()

    def get_max_length(self) -> int:
        return self.cache.max_len


class BlockKVCache(PreallocatedCache):
    """A ``transformers.Cache`` whose layers keep K/V in block pools behind one device table.

    The surface the decode step uses is the static cache's (``write_pos``, ``max_len``,
    ``load_prefill``, ``advance``, ``release``, ``puts_through`` from
    :class:`~graphcap.rollout.cache.cache.PreallocatedCache`, whose layout answers this class
    gives for a table; ``reset`` and ``nbytes`` here) plus the table's: ``table``, ``lengths``,
    :attr:`view`, :meth:`assign`, :meth:`free_rows`.
    """

    grows = True

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        batch_size: int,
        max_len: int,
        block_size: int,
        num_blocks: int | None = None,
        memory: KVMemory = contextlib.nullcontext,
    ):
        if not specs:
            raise ValueError("a cache needs at least one layer spec")
        if max_len % block_size:
            raise ValueError(f"max_len {max_len} is not a whole number of {block_size}-blocks")
        device = specs[0].device
        self.block_size, self.max_len, self.memory = block_size, max_len, memory
        self.write_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.table = torch.full(
            (batch_size, max_len // block_size), kv_blocks.NULL_BLOCK, dtype=torch.int32,
            device=device,
        )  # fmt: skip
        self.table[:, 0] = SINK_BLOCK
        self.lengths = torch.ones(batch_size, dtype=torch.int32, device=device)
        self.view = kv_blocks.BlockView(self.table, self.lengths, block_size)
        blocks = max(num_blocks or 0, _RESERVED + batch_size)
        #: the host side (see :class:`Holdings`); only :meth:`_commit` and :meth:`_grow` set it
        self.book = Holdings(tuple(range(_RESERVED, blocks)), ((),) * batch_size)
        super().__init__(layers=[BlockKVLayer(s, self, blocks) for s in specs])

    @property
    def num_blocks(self) -> int:
        """Blocks per pool (null and sink included): a shape every captured graph bakes in."""
        return int(self.layers[0].keys.shape[0])

    @property
    def free(self) -> tuple[int, ...]:
        """Free block ids (the last is handed out first)."""
        return self.book.free

    @property
    def owned(self) -> tuple[tuple[int, ...], ...]:
        """The blocks each row holds, in table order."""
        return self.book.owned

    @property
    def growths(self) -> int:
        """How many times the pools grew (each growth replaces the pool tensors)."""
        return self.book.growths

    @property
    def peak_held(self) -> int:
        """The most blocks rows held at once since the last :meth:`reset`."""
        return self.book.peak_held

    @property
    def blocks_held(self) -> int:
        return self.book.held

    def reading(self, attention: str) -> contextlib.AbstractContextManager[None]:
        """Within the block a forward with attention ``attention`` reads this table's view when
        that attention is block-aware (every layer then returns its pools)."""
        if reads_blocks(attention):
            return kv_blocks.reading_blocks(self.view)
        return contextlib.nullcontext()

    def assign(
        self,
        columns: Sequence[int | None],
        ahead: int,
        before_growth: Callable[[], None] | None = None,
    ) -> int:
        """Give row ``b`` blocks through ``columns[b] + ahead`` when ``columns[b]`` (the column
        it writes next, a host value; ``None`` for idle rows) is not covered yet. Blocks come
        from the free list, zeroed first (stale K/V must not poison a masked column: a NaN
        enters ``q @ k`` before the mask is added); when it runs dry the pools grow, after
        ``before_growth`` (which drops the graphs reading the old pools). Returns the number of
        blocks handed out. Between replays only; all or nothing (:meth:`_commit`).

        The pools also grow early enough that they hold the blocks the rows' lengths span, an
        idle row (length 1, on the shared sink block) counting one: a paged kernel may size its
        work by that sum and refuse a pool smaller than it (Ascend's page attention does). Rows
        hold the blocks their lengths span, so that is: free blocks plus the two reserved ones at
        least the idle rows."""
        size, per_row = self.block_size, self.table.shape[1]
        wanted: list[tuple[int, int]] = []  # (row, table entry)
        for row, column in enumerate(columns):
            if column is None or column // size < len(self.owned[row]):
                continue
            last = min((column + ahead) // size, per_row - 1)
            wanted += [(row, entry) for entry in range(len(self.owned[row]), last + 1)]
        spare = max(columns.count(None) - _RESERVED, 0)  # blocks idle rows count beyond these
        if len(wanted) + spare > len(self.free):
            if before_growth is not None:
                before_growth()
            self._grow(len(wanted) + spare - len(self.free))
        if not wanted:
            return 0
        book, count = self.book, len(wanted)
        ids = book.free[: -count - 1 : -1]  # the last free first
        owned = list(book.owned)
        for (row, _), block in zip(wanted, ids, strict=True):
            owned[row] += (block,)
        held = book.held + count
        taken = replace(
            book, free=book.free[:-count], owned=tuple(owned), peak_held=max(book.peak_held, held)
        )
        device = self.table.device
        picked = torch.tensor(ids, dtype=torch.long).to(device)
        rows = torch.tensor([r for r, _ in wanted], dtype=torch.long).to(device)
        entries = torch.tensor([e for _, e in wanted], dtype=torch.long).to(device)

        def write() -> None:
            for layer in self.layers:
                layer.keys[picked] = 0
                layer.values[picked] = 0
            self.table[rows, entries] = picked.to(torch.int32)

        self._commit(taken, rows, write)
        return count

    def _commit(self, book: Holdings, rows: torch.Tensor, write: Callable[[], None]) -> None:
        """Run ``write`` (the device side of a step: writes to ``rows`` of the table, lengths
        and write positions, and to free blocks), then take ``book`` as the host side, in one
        assignment. Whatever raises before that (an interrupt included) puts those rows back,
        so the device and host sides change together or not at all (free blocks' contents
        are never read)."""
        tensors = (self.table, self.lengths, self.write_pos)
        before = [tensor[rows] for tensor in tensors]  # an index tensor: copies
        try:
            write()
            self.book = book
        except BaseException:
            for tensor, saved in zip(tensors, before, strict=True):
                tensor[rows] = saved
            raise

    def _grow(self, missing: int) -> None:
        """New, larger pools (old blocks copied over): at least ``missing`` more free blocks.
        Doubling keeps recaptures few; it stops at every row's whole table (the static cache's
        row length in whole blocks, plus the two reserved ones), which no call can need more
        than.

        All or nothing: when an allocation fails (or the process is interrupted) part-way, each
        pool grown so far is replaced by a copy of its first ``old`` blocks (which hold the old
        contents; the memory its old pool freed is what the copy takes), and the grown one is
        freed, so every layer keeps one size, holds what ``nbytes`` says, and the next call
        grows again."""
        old = self.num_blocks
        new = min(max(2 * old, old + missing), self.batch_size * self.table.shape[1] + _RESERVED)
        with self.memory():
            self._grow_pools(old, new)

    def _grow_pools(self, old: int, new: int) -> None:
        """:meth:`_grow`'s allocation (in the cache's :attr:`memory`): every layer's pools at
        ``new`` blocks and the new blocks free, or none of it."""
        pools = [(layer, name) for layer in self.layers for name in ("keys", "values")]
        try:
            for layer, name in pools:
                pool = getattr(layer, name)
                grown = pool.new_zeros((new, *pool.shape[1:]))
                grown[:old].copy_(pool)
                setattr(layer, name, grown)  # the old pool goes before the next is made
                del pool, grown
            book = self.book
            self.book = replace(
                book, free=book.free + tuple(range(old, new)), growths=book.growths + 1
            )
        except BaseException:
            for layer, name in pools:
                if getattr(layer, name).shape[0] != old:
                    setattr(layer, name, getattr(layer, name)[:old].clone())
            raise

    def free_rows(self, rows: Sequence[int]) -> None:
        """Return rows' blocks to the free list; the rows then point at the sink block, write
        at column 0 and read one column (idle slots). All or nothing (:meth:`_commit`)."""
        rows = list(rows)
        if not rows:
            return
        free, owned = list(self.book.free), list(self.book.owned)
        for row in rows:
            free += reversed(owned[row])  # last freed, first reused
            owned[row] = ()
        self._commit(replace(self.book, free=tuple(free), owned=tuple(owned)), *self._idle(rows))

    def _idle(self, rows: Sequence[int]) -> tuple[torch.Tensor, Callable[[], None]]:
        """``rows`` as an index, and the device writes that make them idle: the sink block
        only, write position 0, one column read."""
        index = torch.tensor(list(rows), dtype=torch.long).to(self.table.device)

        def write() -> None:
            self.table[index] = kv_blocks.NULL_BLOCK
            self.table[index, 0] = SINK_BLOCK
            self.lengths[index] = 1
            self.write_pos[index] = 0

        return index, write

    def set_lengths(self, furthest: torch.Tensor) -> None:
        """``lengths`` = ``furthest + 1`` (device): the columns each row's kernel must read."""
        self.lengths.copy_(furthest + 1)

    def step_tensors(self) -> list[torch.Tensor]:
        return [self.write_pos, self.lengths]

    @property
    def sink_column(self) -> int:
        """Idle rows write column 0 of the sink block (:meth:`free_rows`)."""
        return 0

    def reset_for_call(self) -> None:
        """A continuous call starts with every row idle and every block free (:meth:`reset`)."""
        self.reset()

    def clear_rows(self, rows: Sequence[int]) -> None:
        """Free ``rows``' blocks (:meth:`free_rows`; each is zeroed when handed out again)."""
        self.free_rows(rows)

    def figures(self) -> dict[str, object]:
        return {
            "kv_cache_bytes": self.nbytes(),
            "kv_layout": "blocks",
            "kv_blocks_held": self.peak_held,
            "kv_pool_growths": self.growths,
        }

    def reset(self) -> None:
        """Every row idle, every block free (block contents are zeroed as they are reused):
        the host side built afresh, whatever it held."""
        free = tuple(range(self.num_blocks - 1, _RESERVED - 1, -1))
        fresh = Holdings(free, ((),) * self.batch_size, growths=self.growths)
        self._commit(fresh, *self._idle(range(self.batch_size)))

    def prefill_writer(self, rows: torch.Tensor | None, width: int) -> PrefillWriter:
        """Through the table, looked up once for every layer (the rows' blocks are assigned
        first, :meth:`assign`)."""
        table = self.table if rows is None else self.table[rows]
        columns = torch.arange(width, device=table.device)
        blocks = table[:, columns // self.block_size].to(torch.long)[:, None, :]  # (R, 1, W)
        offsets = (columns % self.block_size)[None, None, :]

        def write(layer: PreallocatedLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
            put_columns(layer.keys, layer.values, (blocks, layer.heads, offsets), keys, values)

        return write

    def leading(self, rows: int) -> BlockKVCache:
        """The first ``rows`` rows' table, lengths and write positions, as views, over the same
        pools: what a step of a smaller batch size reads and writes. Host bookkeeping (blocks
        handed out, growth) stays with this cache; a growth replaces the pools, so a view is
        taken again after one."""
        view = copy.copy(self)
        view.write_pos, view.table = self.write_pos[:rows], self.table[:rows]
        view.lengths = self.lengths[:rows]
        view.view = kv_blocks.BlockView(view.table, view.lengths, self.block_size)
        view.layers = []
        for layer in self.layers:
            narrowed = copy.copy(layer)
            narrowed.cache = view
            view.layers.append(narrowed)
        return view

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Swap rows ``dst`` and ``src``: their table rows, lengths, write positions and the
        blocks each holds (no K/V moves: the table says where a row's blocks are). Between
        replays."""
        index, swapped = torch.cat([dst, src]), torch.cat([src, dst])
        owned = list(self.owned)
        for a, b in zip(dst.tolist(), src.tolist(), strict=True):
            owned[a], owned[b] = owned[b], owned[a]

        def write() -> None:
            for tensor in (self.table, self.lengths, self.write_pos):
                tensor[index] = tensor[swapped]

        self._commit(replace(self.book, owned=tuple(owned)), index, write)

    def nbytes(self) -> int:
        tensors = [t for layer in self.layers for t in (layer.keys, layer.values)]
        tensors += [self.table, self.lengths]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
