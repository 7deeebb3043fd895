"""graphcap's static KV cache: preallocated K/V written at device-held positions.

transformers' ``StaticLayer`` advances its own ``cumulative_length`` counter inside ``update``;
a captured step would replay that advance on every replay and hide it from the host. Here the
write position is one ``(B,)`` device tensor shared by every layer, advanced explicitly by the
decode step (:meth:`StaticKVCache.advance`), so a replay moves it exactly once per step and each
row may sit at its own position (the continuous path needs that).

Buffers are sized from the K/V tensors the model actually produced in prefill (the right head
count on tensor-parallel ranks, the right head dims for models with distinct K/V dims), are
zero-filled, and are allocated before any capture, never during one.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from graphcap.rollout.cache.swap import attributes_swapped


@dataclass(frozen=True)
class LayerSpec:
    """Shape facts of one layer's K/V, taken from a real forward."""

    num_heads: int
    k_head_dim: int
    v_head_dim: int
    k_dtype: torch.dtype
    v_dtype: torch.dtype
    device: torch.device

    @classmethod
    def from_kv(cls, keys: torch.Tensor, values: torch.Tensor) -> LayerSpec:
        if keys.dim() != 4 or values.dim() != 4:
            raise ValueError(
                f"expected K/V shaped (batch, heads, seq, head_dim), got {tuple(keys.shape)} and "
                f"{tuple(values.shape)}; this model's cache layout is not supported"
            )
        return cls(
            keys.shape[1], keys.shape[-1], values.shape[-1], keys.dtype, values.dtype, keys.device
        )


#: Where K/V buffers are allocated: a context manager factory (an engine's memory region, whose
#: K/V contents need not survive a sleep: a call writes every column it reads).
KVMemory = Callable[[], contextlib.AbstractContextManager[None]]


class PreallocatedLayer(CacheLayerMixin):
    """K/V buffers ``(leading, H, columns, D)`` allocated up front (never lazily, never inside a
    capture) and written through an index by ``put`` (:func:`put_columns`'s arguments; the
    cache's ``puts_through`` swaps it): what the static and the block layers share."""

    is_compileable = True
    is_sliding = False
    supports_early_init = False

    def __init__(
        self,
        spec: LayerSpec,
        leading: int,
        columns: int,
        put: Callable[..., None],
        memory: KVMemory = contextlib.nullcontext,
    ):
        super().__init__()
        with memory():  # the K/V buffers alone: the indices beside them must survive a sleep
            self.keys = torch.zeros(
                (leading, spec.num_heads, columns, spec.k_head_dim),
                dtype=spec.k_dtype,
                device=spec.device,
            )
            self.values = torch.zeros(
                (leading, spec.num_heads, columns, spec.v_head_dim),
                dtype=spec.v_dtype,
                device=spec.device,
            )
        #: the head of every written element, for the indexed write
        self.heads = torch.arange(spec.num_heads, device=spec.device).view(1, spec.num_heads, 1)
        self.put = put
        self.dtype, self.device = spec.k_dtype, spec.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError(
            f"{type(self).__name__} is allocated up front; lazy initialisation never runs"
        )

    def reset(self) -> None:
        self.keys.zero_()
        self.values.zero_()


class StaticKVLayer(PreallocatedLayer):
    """One layer: ``keys``/``values`` of shape ``(B, H, L, D)`` and a shared write position."""

    def __init__(
        self,
        spec: LayerSpec,
        batch_size: int,
        max_len: int,
        write_pos: torch.Tensor,
        memory: KVMemory = contextlib.nullcontext,
    ):
        super().__init__(spec, batch_size, max_len, scatter_columns, memory)
        self.max_len = max_len
        self.batch_size = batch_size
        self.write_pos = write_pos
        # the row of every written element, for the indexed write (:func:`put_columns`)
        self.rows = torch.arange(batch_size, device=spec.device).view(batch_size, 1, 1)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``q`` new columns per row at ``write_pos[b] + i``; return the whole buffers."""
        columns = self.write_pos[:, None, None]  # a decode step: no kernel to find its column
        if key_states.shape[2] > 1:
            columns = columns + torch.arange(key_states.shape[2], device=columns.device)
        index = (self.rows, self.heads, columns)
        self.put(self.keys, self.values, index, key_states, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_len, 0

    def get_seq_length(self) -> torch.Tensor:  # type: ignore[override]
        """The furthest write position, as a device tensor (a host int would force a sync)."""
        return self.write_pos.max()

    def get_max_length(self) -> int:
        return self.max_len

    def leading(self, rows: int, write_pos: torch.Tensor) -> StaticKVLayer:
        """This layer's first ``rows`` rows, as views (see :meth:`StaticKVCache.leading`)."""
        view = copy.copy(self)
        view.keys, view.values = self.keys[:rows], self.values[:rows]
        view.rows, view.write_pos, view.batch_size = self.rows[:rows], write_pos, rows
        return view


#: Writes one layer's prefill K/V (:meth:`PreallocatedCache.prefill_writer`).
PrefillWriter = Callable[[PreallocatedLayer, torch.Tensor, torch.Tensor], None]


class PreallocatedCache(Cache):
    """What the static cache and the block table share: one ``(B,)`` device write position
    (``write_pos``), a logical row length (``max_len``), layers of :class:`PreallocatedLayer`,
    the prefill copy's checks and row choice, the swapped write and the release; and the
    answers the decode paths ask of a layout (``grows``, :attr:`sink_column`,
    :meth:`step_tensors`, :meth:`set_lengths`, :meth:`reading`, :meth:`reset_for_call`,
    :meth:`clear_rows`, :meth:`figures`), here the static cache's."""

    write_pos: torch.Tensor
    max_len: int

    #: where K/V buffers are allocated (a block pool's growth too): an engine's memory region
    memory: KVMemory = contextlib.nullcontext
    #: whether rows are handed blocks between steps (:meth:`BlockKVCache.assign`, whose pools
    #: grow); the static cache holds every row's columns from the start
    grows: ClassVar[bool] = False

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        return tuple(LayerSpec.from_kv(layer.keys, layer.values) for layer in self.layers)

    def clear(self) -> None:
        """Zero every K/V buffer (memory mapped again after a sleep holds no values)."""
        for layer in self.layers:
            layer.reset()

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return int(self.write_pos.shape[0])

    def load_prefill(
        self,
        prefill: Cache,
        rows: torch.Tensor | None = None,
        source_rows: torch.Tensor | None = None,
    ) -> None:
        """Copy a prefill's K/V into columns ``[0, W)``.

        ``source_rows`` (long device tensor) says which prefill row each destination row copies
        (samples of a prompt, padding rows of a bucket); by default row i copies row i. ``rows``
        names the destination rows, for callers that refill part of the batch; by default all.
        The write position of the touched rows becomes ``W``.
        """
        if len(prefill.layers) != len(self.layers):
            raise ValueError(
                f"prefill cache has {len(prefill.layers)} layers, {type(self).__name__} "
                f"{len(self.layers)}"
            )
        width = prefill.layers[0].keys.shape[-2]
        if width > self.max_len:
            raise ValueError(f"prompt width {width} exceeds cache length {self.max_len}")
        write = self.prefill_writer(rows, width)
        for src, dst in zip(prefill.layers, self.layers, strict=True):
            keys, values = src.keys, src.values
            if source_rows is not None:
                keys, values = (
                    keys.index_select(0, source_rows),
                    values.index_select(0, source_rows),
                )
            write(dst, keys, values)
        if rows is None:
            self.write_pos.fill_(width)
        else:
            self.write_pos[rows] = width

    def prefill_writer(self, rows: torch.Tensor | None, width: int) -> PrefillWriter:
        """How each layer's prefill K/V ``(R, H, width, D)`` goes into columns ``[0, width)``
        of ``rows`` (all rows for ``None``); built once a prefill, called once a layer."""
        raise NotImplementedError

    def puts_through(self, put: Callable[..., None]) -> contextlib.AbstractContextManager[None]:
        """Within the block every layer writes with ``put`` (the arguments of
        :func:`scatter_columns`), e.g. a compiled :func:`put_columns` for a capture."""
        return attributes_swapped([(layer, "put", put) for layer in self.layers])

    def advance(self, steps: int = 1) -> None:
        """Move every row's write position on (in place, so a replay moves it too)."""
        self.write_pos.add_(steps)

    def step_tensors(self) -> list[torch.Tensor]:
        """The cache's small buffers a decode step writes (a capture's snapshot restores them)."""
        return [self.write_pos]

    def set_lengths(self, furthest: torch.Tensor) -> None:
        """Tell the cache the furthest column each row reads this step; the static cache reads
        every column (the mask closes the rest), so nothing to do here."""

    def reading(self, attention: str) -> contextlib.AbstractContextManager[None]:
        """The context a forward with attention ``attention`` runs in: none for static K/V."""
        return contextlib.nullcontext()

    @property
    def sink_column(self) -> int:
        """Where an idle row writes, so it stays in bounds however long it waits: the last
        column (no real token reaches it)."""
        return self.max_len - 1

    def reset_for_call(self) -> None:
        """Ready the cache for a continuous call: nothing here, each slot is cleared as it is
        filled (:meth:`clear_rows`)."""

    def clear_rows(self, rows: Sequence[int]) -> None:
        """Forget ``rows``' K/V: zero their columns (a stale NaN would poison the next
        occupant's ``q @ k`` even where masked)."""
        index = torch.tensor(list(rows), dtype=torch.long).to(self.write_pos.device)
        for layer in self.layers:
            layer.keys[index] = 0
            layer.values[index] = 0

    def figures(self) -> dict[str, object]:
        """The cache's figures for a call's stats, by their ``RolloutStats`` names."""
        return {"kv_cache_bytes": self.nbytes()}

    def nbytes(self) -> int:
        raise NotImplementedError

    def release(self) -> None:
        """Drop the buffers so their memory can be returned; the cache is unusable afterwards."""
        for layer in self.layers:
            layer.keys = None
            layer.values = None
            layer.is_initialized = False
        self.layers = []


class StaticKVCache(PreallocatedCache):
    """A ``transformers.Cache`` of :class:`StaticKVLayer` sharing one ``(B,)`` write position."""

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        batch_size: int,
        max_len: int,
        memory: KVMemory = contextlib.nullcontext,
    ):
        if not specs:
            raise ValueError("a cache needs at least one layer spec")
        device = specs[0].device
        self.write_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len, self.memory = max_len, memory
        layers = [StaticKVLayer(s, batch_size, max_len, self.write_pos, memory) for s in specs]
        super().__init__(layers=layers)

    @staticmethod
    def specs_of(prefill: Cache) -> tuple[LayerSpec, ...]:
        """Per-layer shape facts of the K/V a prefill forward produced."""
        return tuple(LayerSpec.from_kv(layer.keys, layer.values) for layer in prefill.layers)

    def reset(self) -> None:
        """Zero every K/V buffer and the write positions (keeps the same tensors)."""
        for layer in self.layers:
            layer.reset()
        self.write_pos.zero_()

    def prefill_writer(self, rows: torch.Tensor | None, width: int) -> PrefillWriter:
        def write(layer: PreallocatedLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
            if rows is None:
                layer.keys[:, :, :width].copy_(keys)
                layer.values[:, :, :width].copy_(values)
            else:
                layer.keys[rows, :, :width] = keys
                layer.values[rows, :, :width] = values

        return write

    def nbytes(self) -> int:
        tensors = (t for layer in self.layers for t in layer_tensors(layer))
        return sum(t.numel() * t.element_size() for t in tensors)

    def leading(self, rows: int) -> StaticKVCache:
        """This cache's first ``rows`` rows, as views of the same buffers: a step of a smaller
        batch size reads and writes them in place (the live rows moved there first,
        :meth:`move_rows`)."""
        view = copy.copy(self)
        view.write_pos = self.write_pos[:rows]
        view.layers = [layer.leading(rows, view.write_pos) for layer in self.layers]
        return view

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy rows ``src``'s K/V and write positions to rows ``dst`` (between replays; the
        rows at ``dst`` have ended, so nothing of theirs is kept)."""
        for layer in self.layers:
            layer.keys[dst] = layer.keys[src]
            layer.values[dst] = layer.values[src]
        self.write_pos[dst] = self.write_pos[src]


def scatter_columns(
    keys: torch.Tensor,
    values: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    key_states: torch.Tensor,
    value_states: torch.Tensor,
) -> None:
    """Write new K/V columns (batch, heads, q, dim) at ``index`` (rows, heads, columns) with two
    scatters: eagerly the fastest write, faster than two ``index_put_`` (docs/decisions.md,
    decision 25). Under autocast K and V can
    arrive in other dtypes than the buffers; they are stored as prefill stored them."""
    columns = index[2][..., None]  # (batch, 1, q, 1)
    keys.scatter_(
        2, columns.expand(*key_states.shape[:3], keys.shape[-1]), key_states.to(keys.dtype)
    )
    values.scatter_(
        2, columns.expand(*value_states.shape[:3], values.shape[-1]), value_states.to(values.dtype)
    )


def put_columns(
    keys: torch.Tensor,
    values: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    key_states: torch.Tensor,
    value_states: torch.Tensor,
) -> None:
    """:func:`scatter_columns` as an indexed put, the form to compile: ``torch.compile`` keeps it
    in place and fuses K's and V's into one kernel, where a compiled ``scatter_`` copies the
    whole buffer (docs/decisions.md, decisions 25 and 44)."""
    keys.index_put_(index, key_states.to(keys.dtype))
    values.index_put_(index, value_states.to(values.dtype))


def layer_tensors(layer: CacheLayerMixin) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in (layer.keys, layer.values) if t is not None)


class _SpanLayer(CacheLayerMixin):
    """One layer of :class:`SpanView`: writes through, reads columns ``[lo, hi)``."""

    is_compileable = False
    is_sliding = False

    def __init__(self, inner: StaticKVLayer, lo: int, hi: int):
        super().__init__()
        self.inner, self.lo, self.hi = inner, lo, hi
        self.keys, self.values = inner.keys, inner.values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a span view wraps allocated buffers; lazy initialisation never runs")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.inner.update(key_states, value_states, *args, **kwargs)
        return keys[:, :, self.lo : self.hi], values[:, :, self.lo : self.hi]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.hi - self.lo, 0

    def get_seq_length(self) -> torch.Tensor:  # type: ignore[override]
        return self.inner.get_seq_length()

    def get_max_length(self) -> int:
        return self.hi - self.lo


class SpanView(Cache):
    """A static cache seen through columns ``[lo, hi)`` (host ints: frozen into a captured graph).

    K/V are still written at the absolute write positions; attention reads only the span (the
    written columns of a per-position graph, the live columns of a trimmed or aligned layout).
    """

    def __init__(self, cache: StaticKVCache, lo: int, hi: int):
        super().__init__(layers=[_SpanLayer(layer, lo, hi) for layer in cache.layers])
