"""A per-layer K/V table that grows as layers are first seen, then stays put for graph replay.

The NPU rollout work kept one preallocated K/V buffer pair per layer, in the BNSD layout
``npu_fusion_attention_v3`` reads, so attention consumes the cache without a copy. Layers are
allocated from the K/V tensors the model actually produces on the warm-up / prefill forward
(right on tensor-parallel ranks, where each holds a shard of the heads), never during a capture:
an allocation inside a capture would be recorded as graph-private memory and the layer would
be missing from every replay. Write positions live in a device tensor, so a captured step writes
where the positions point at replay time, and advances them itself.

Relation to graphcap's static cache (``graphcap.rollout``): that is the ``transformers.Cache``
the model talks to; this table is storage such a cache can delegate to (``update`` has the
shape of ``Cache.update``). Nothing here is NPU-specific: it is pure torch and runs on any device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from graphcap.errors import GraphCaptureError


class GrowableKVTable:
    """Preallocated K/V buffers of shape (batch, kv_heads, max_length, head_dim) per layer.

    ``is_capturing`` is the backend's ``is_current_stream_capturing``: growth is refused while
    it returns True. With ``per_row=True`` each batch row has its own write position (slots of a
    continuous batch); otherwise all rows share one.
    """

    def __init__(
        self,
        max_length: int,
        *,
        is_capturing: Callable[[], bool],
        per_row: bool = False,
        check_positions: bool = True,
    ) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be at least 1, not {max_length}")
        self.max_length = max_length
        self.per_row = per_row
        #: Check positions against the capacity on eager writes (one host read per forward).
        self.check_positions = check_positions
        self._is_capturing = is_capturing
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._first_layer: int | None = None
        #: Where the next write lands: shape (1,) shared, or (batch,) per row; int64 on device.
        self.positions: torch.Tensor | None = None

    # ---- growth ---------------------------------------------------------------------------
    def ensure_layer(
        self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers of ``layer_idx``, allocated (zero-filled) from these K/V if it is new."""
        existing = self._layers.get(layer_idx)
        if existing is not None:
            self._check_fits(layer_idx, existing, key_states, value_states)
            return existing
        if self._is_capturing():
            raise GraphCaptureError(
                f"KV table: layer {layer_idx} was first seen during a graph capture; its "
                "buffers would be graph-private and missing at replay. Run one eager forward "
                "(warm-up or prefill) through every layer before capturing."
            )
        if key_states.dim() != 4 or value_states.dim() != 4:
            raise ValueError(
                "KV table expects K/V of shape (batch, kv_heads, seq, head_dim) (BNSD); got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        if key_states.shape[:2] != value_states.shape[:2]:
            raise ValueError(
                f"key {tuple(key_states.shape)} and value {tuple(value_states.shape)} must agree "
                "on batch and kv_heads"
            )
        batch = key_states.shape[0]
        if self.positions is not None and self._batch != batch:
            raise ValueError(
                f"layer {layer_idx} has batch {batch}, but the table was built for batch "
                f"{self._batch}; build a new table for another batch size"
            )
        buffers = (self._allocate(key_states), self._allocate(value_states))
        if self.positions is None:
            size = batch if self.per_row else 1
            self.positions = torch.zeros(size, dtype=torch.int64, device=key_states.device)
            self._first_layer = layer_idx
        self._layers[layer_idx] = buffers
        return buffers

    def _allocate(self, states: torch.Tensor) -> torch.Tensor:
        batch, heads, _, head_dim = states.shape
        return torch.zeros(
            batch, heads, self.max_length, head_dim, dtype=states.dtype, device=states.device
        )

    @property
    def _batch(self) -> int:
        first = next(iter(self._layers.values()))[0]
        return first.shape[0]

    def _check_fits(
        self,
        layer_idx: int,
        buffers: tuple[torch.Tensor, torch.Tensor],
        key_states: torch.Tensor,
        value_states: torch.Tensor,
    ) -> None:
        pairs = (("key", buffers[0], key_states), ("value", buffers[1], value_states))
        for what, buffer, states in pairs:
            expected = (buffer.shape[0], buffer.shape[1], buffer.shape[3])
            got = (states.shape[0], states.shape[1], states.shape[3]) if states.dim() == 4 else None
            if got != expected or states.dtype != buffer.dtype or states.device != buffer.device:
                raise ValueError(
                    f"KV table layer {layer_idx}: {what} of shape {tuple(states.shape)} "
                    f"({states.dtype}, {states.device}) does not fit buffers of (batch, heads, "
                    f"head_dim) = {expected} ({buffer.dtype}, {buffer.device}); the model or "
                    "batch changed, so build a new table"
                )

    # ---- writes ---------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write K/V at the current positions; return the layer's whole buffers.

        Positions are not advanced here (every layer of one forward writes at the same place):
        call :meth:`advance` once per forward.
        """
        key_buffer, value_buffer = self.ensure_layer(layer_idx, key_states, value_states)
        steps = key_states.shape[2]
        if steps > self.max_length:
            raise ValueError(
                f"KV table: writing {steps} positions exceeds its capacity of {self.max_length}"
            )
        if self.check_positions and layer_idx == self._first_layer and not self._is_capturing():
            self._check_positions(steps)
        index = self._write_index(steps, key_states.shape)
        if self.per_row:
            key_buffer.scatter_(2, index, key_states)
            value_buffer.scatter_(2, self._write_index(steps, value_states.shape), value_states)
        else:
            key_buffer.index_copy_(2, index, key_states)
            value_buffer.index_copy_(2, index, value_states)
        return key_buffer, value_buffer

    def _write_index(self, steps: int, shape: torch.Size) -> torch.Tensor:
        positions = self._require_positions()
        offsets = torch.arange(steps, dtype=torch.int64, device=positions.device)
        if not self.per_row:
            return positions + offsets
        per_row = positions[:, None] + offsets[None, :]
        return per_row[:, None, :, None].expand(shape[0], shape[1], steps, shape[3])

    def _check_positions(self, steps: int) -> None:
        positions = self._require_positions()
        # One host read per forward, outside captures only: bad positions fail here with a
        # message instead of as an index error (or a device fault) deep inside a write.
        low = int(positions.min())
        high = int(positions.max())
        if low < 0 or high + steps > self.max_length:
            raise ValueError(
                f"KV table overflow: writing {steps} position(s) at positions {low}..{high} "
                f"needs capacity {high + steps}, but the table holds {self.max_length}; build it "
                "with a larger max_length or stop generating at the limit"
            )

    def advance(self, steps: int = 1) -> None:
        """Move every write position on by ``steps``, in place (a captured step records it)."""
        self._require_positions().add_(steps)

    def set_positions(self, positions: torch.Tensor | int) -> None:
        """Overwrite the write positions in place (outside captures), keeping their address."""
        self._require_positions().copy_(torch.as_tensor(positions, dtype=torch.int64))

    def reset(self) -> None:
        """Zero every buffer and position in place; addresses (and captured graphs) stay valid."""
        for key_buffer, value_buffer in self._layers.values():
            key_buffer.zero_()
            value_buffer.zero_()
        if self.positions is not None:
            self.positions.zero_()

    def _require_positions(self) -> torch.Tensor:
        if self.positions is None:
            raise RuntimeError("KV table has no layers yet: run a forward through it first")
        return self.positions

    # ---- inspection -----------------------------------------------------------------------
    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (key, value) buffers of a layer that has been seen."""
        try:
            return self._layers[layer_idx]
        except KeyError:
            seen = sorted(self._layers)
            raise KeyError(f"KV table has no layer {layer_idx}; layers seen: {seen}") from None

    def __contains__(self, layer_idx: object) -> bool:
        return layer_idx in self._layers

    def __len__(self) -> int:
        return len(self._layers)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._layers))

    @property
    def nbytes(self) -> int:
        """Bytes held by all K/V buffers."""
        return sum(k.nbytes + v.nbytes for k, v in self._layers.values())
