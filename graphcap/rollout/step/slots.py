"""The slot machinery of continuous batching: a decode step that holds finished rows still, and
the host-side table that retires, clears and refills slots between steps.

A slot is one row of the static cache / mask / decode-state buffers. Its request's padded prompt
occupies columns ``[start, start + W)`` and its tokens follow. The last column of the buffers is
a *sink*: an empty or finished slot's write position points there, so the step (which always
runs over every slot) writes its K/V, pad token and mask bit into a column no request reads,
and never past the buffer end; its position id stops advancing, so learned position tables are
never indexed out of range. On a block table the sink is column 0 of the shared sink block
(:mod:`graphcap.rollout.cache.blocks`): an idle row then reads one column, not a whole row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphcap.rollout.settings.sampling_params import SamplingParams
from graphcap.rollout.step.step import DecodeState, DecodeStep


def allocate_state(
    slots: int,
    total_len: int,
    vocab_size: int,
    eos_ids: tuple[int, ...],
    pad_id: int,
    device: torch.device,
) -> DecodeState:
    """A :class:`DecodeState` whose step counter is per row ``(N, 1)``: slots start at
    different times, so ``min_new_tokens`` and the length limit count each row's own tokens."""
    state = DecodeState.allocate(slots, total_len, vocab_size, eos_ids, pad_id, device)
    state.generated = torch.zeros((slots, 1), dtype=torch.long, device=device)
    return state


class ContinuousStep(DecodeStep):
    """The static path's decode step with two per-row rules added.

    * finished (or empty) rows do not advance: their write position goes to the sink column and
      their position id stays, so idle slots stay in bounds however long they wait;
    * a row finishes when it has generated its own ``limits[row]`` tokens, as well as at EOS.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Takes :class:`DecodeStep`'s arguments; adds the per-row limits and the sink column."""
        super().__init__(*args, **kwargs)
        device = self.state.finished.device
        slots = self.state.finished.shape[0]
        self.limits = torch.zeros(slots, dtype=torch.long, device=device)
        self.sink = torch.full((), self.cache.sink_column, dtype=torch.long, device=device)
        #: block table only: the column the host's ``SlotTable.column`` holds for each busy slot
        #: (it runs on past EOS, capped like the host's), 0 for idle ones; the kernel's lengths
        #: follow it, so a backend taking lengths as host values gets them without a device read
        grows = self.cache.grows
        self.reach = torch.zeros(slots, dtype=torch.long, device=device) if grows else None

    allocate_state = staticmethod(allocate_state)
    #: slots hold requests of any length: the pool follows the tokens held, growing as needed
    pool_for_bucket = False

    def _slot_tensors(self) -> list[torch.Tensor]:
        """The slots' own per-row buffers: each slot's token limit and, on a block table, reach."""
        return [self.limits] + ([self.reach] if self.reach is not None else [])

    def mutable_tensors(self) -> list[torch.Tensor]:
        return [*super().mutable_tensors(), *self._slot_tensors()]

    def row_tensors(self) -> list[torch.Tensor]:
        """The step's per-row buffers, the limits and reach among them (they move with a row)."""
        return [*super().row_tensors(), *self._slot_tensors()]

    def leading(self, rows: int) -> ContinuousStep:
        """The first ``rows`` slots, limits and reach narrowed too (the live-row ladder)."""
        narrowed = super().leading(rows)
        assert isinstance(narrowed, ContinuousStep)
        narrowed.limits = self.limits[:rows]
        narrowed.reach = None if self.reach is None else self.reach[:rows]
        return narrowed

    def furthest(self) -> torch.Tensor:
        """Idle and finished rows sit at the sink, so a row's furthest open column is its
        reach (block table), or the buffer end (the static cache's sink column)."""
        if self.reach is None:
            return super().furthest()
        return self.reach

    def advance(self) -> None:
        s = self.state
        wp = self.cache.write_pos
        wp.copy_(torch.where(s.finished, self.sink, wp + 1))
        s.positions.add_((~s.finished).to(torch.long).view(-1, 1))
        if self.reach is not None:
            cap = s.sequences.shape[1] - 2  # the host's cap on SlotTable.column
            self.reach.copy_(torch.where(self.reach > 0, (self.reach + 1).clamp(max=cap), 0))

    def commit(self, logits: torch.Tensor) -> None:
        super().commit(logits)
        s = self.state
        s.finished.logical_or_(s.generated.view(-1) >= self.limits)
        s.all_finished.copy_(s.finished.all())

    def configure_rows(
        self, rows: torch.Tensor, params: Sequence[SamplingParams], samples: Sequence[int]
    ) -> None:
        """Sampling settings of the requests entering slots ``rows`` (call before
        :meth:`commit_rows`): ``params[i]`` / sample index ``samples[i]`` for slot ``rows[i]``.
        A seeded row's stream follows its own token count, so it draws what it would on the
        static path; other slots keep their settings."""
        self.state.rows.write(params, samples, rows)

    def commit_rows(self, logits: torch.Tensor, rows: torch.Tensor) -> None:
        """Commit first tokens for the slots in ``rows`` (long), leaving every other slot as it
        was: the refilled slots' first token is chosen by exactly the static path's math."""
        s = self.state
        written = [s.sequences, s.response, s.logprobs, s.finished, s.tokens, s.generated]
        written += [s.stop_hit] if s.stop_hit is not None else []
        before = [t.clone() for t in written]
        full = torch.zeros(
            (s.finished.shape[0], logits.shape[-1]), dtype=logits.dtype, device=logits.device
        )
        full[rows] = logits
        self.commit(full)
        keep = torch.ones_like(s.finished)
        keep[rows] = False
        for live, old in zip(written, before, strict=True):
            live.copy_(torch.where(keep.view(-1, *([1] * (live.dim() - 1))), old, live))
        s.all_finished.copy_(s.finished.all())


@dataclass
class SlotTable:
    """Which request each slot serves (host side). A slot's request uses up its budget at a
    step the host computes (``due``); one that stops earlier (EOS, stop token) is seen only at
    the refill check, from one read of the device ``finished`` flags."""

    request: list[int]
    start: list[int]
    column: list[int]  # each busy slot's write column (exact while its request is active)
    due: list[int]  # the decode step after which each busy slot's request has its budget
    refilled: int = 0
    moved_columns: int = 0

    @classmethod
    def empty(cls, slots: int) -> SlotTable:
        return cls(request=[-1] * slots, start=[0] * slots, column=[0] * slots, due=[0] * slots)

    def occupied(self) -> list[int]:
        return [i for i, r in enumerate(self.request) if r >= 0]

    def due_by(self, step: int) -> list[int]:
        """Busy slots whose request has generated its whole budget after decode step ``step``
        (finished on the device without the host reading it)."""
        return [i for i in self.occupied() if self.due[i] <= step]

    def free(self) -> list[int]:
        return [i for i, r in enumerate(self.request) if r < 0]

    def swap(self, a: int, b: int) -> None:
        """Slots ``a`` and ``b`` trade what they hold (their rows moved on the device)."""
        for column in (self.request, self.start, self.column, self.due):
            column[a], column[b] = column[b], column[a]


def clear_slots(step: ContinuousStep, slots: Sequence[int]) -> None:
    """Forget everything ``slots`` held: K/V, valid mask columns, outputs, counters.

    Stale K/V must not survive: a masked column still enters ``q @ k`` before the mask is added,
    so a NaN or inf left in it would poison the next occupant's attention (a block table zeroes
    freed blocks as it hands them out again).
    """
    s, cache = step.state, step.cache
    rows = torch.tensor(list(slots), dtype=torch.long).to(s.finished.device)
    cache.clear_rows(slots)
    if step.reach is not None:
        step.reach[rows] = 0
    step.masks.valid[rows] = False
    s.sequences[rows] = s.pad
    s.response[rows] = False
    s.logprobs[rows] = 0.0
    s.tokens[rows] = s.pad
    s.positions[rows] = 0
    s.generated[rows] = 0
    s.finished[rows] = True
    if s.stop_hit is not None:
        s.stop_hit[rows] = -1
    step.limits[rows] = 0
    cache.write_pos[rows] = step.sink
    s.all_finished.copy_(s.finished.all())


def shift_row(step: ContinuousStep, row: int, by: int) -> None:
    """Move slot ``row``'s columns ``by`` places (right if positive) in every buffer indexed by
    cache column, filling vacated columns as cleared ones; columns pushed off the left end are
    dropped and the sink column stays put. Position ids do not change, so the model sees the
    same sequence; only where it is stored moves (eager loop only)."""
    if by == 0:
        return
    end = step.cache.max_len - 1  # the sink column, known on the host
    s = step.state
    buffers = [(layer.keys[row], 0) for layer in step.cache.layers]
    buffers += [(layer.values[row], 0) for layer in step.cache.layers]
    buffers += [(step.masks.valid[row], False), (s.sequences[row], s.pad), (s.response[row], False)]
    buffers += [(s.logprobs[row], 0.0)]
    for buf, fill in buffers:
        columns = buf.narrow(-2 if buf.dim() == 3 else -1, 0, end)
        dim = columns.dim() - 2 if buf.dim() == 3 else columns.dim() - 1
        moved = torch.empty_like(columns)
        moved.copy_(fill if not isinstance(fill, torch.Tensor) else fill.expand_as(moved))
        keep = end - abs(by)
        src = columns.narrow(dim, max(-by, 0), keep)
        moved.narrow(dim, max(by, 0), keep).copy_(src)
        columns.copy_(moved)
    step.cache.write_pos[row] += by
