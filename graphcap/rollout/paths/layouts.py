"""The continuous path's eager-only layouts, ``align_decode_fronts`` and ``trim_cache``
(docs/continuous.md, "Layout modes of the eager loop"): they move slots' cache columns between
steps, so their calls run eagerly on the static cache (a graph replays on fixed addresses),
and each eager step attends over the span of columns some busy slot reads. The default path
never enters this module: a call's schedule holds a :class:`ColumnLayout` only where one of
the two is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphcap.rollout.paths.runners import Runner
from graphcap.rollout.settings.rollout_config import RolloutConfig
from graphcap.rollout.step.slots import ContinuousStep, SlotTable, shift_row


def extra_columns(config: RolloutConfig, max_new: int) -> int:
    """Columns a call's buffers add for its layout: aligned fronts may place a row up to
    ``max_new`` further right."""
    return max_new if config.align_decode_fronts else 0


@dataclass
class ColumnLayout:
    """How one call moves its slots' columns. ``pads[r]``: the left-pad columns of request
    ``r``'s prompt (host values); ``width``: the prompts' padded width; ``attended``: the
    columns its steps attended to so far."""

    step: ContinuousStep
    table: SlotTable
    width: int
    pads: Sequence[int]
    align: bool
    trim: bool
    attended: int = 0

    @classmethod
    def for_call(
        cls,
        config: RolloutConfig,
        step: ContinuousStep,
        table: SlotTable,
        mask: torch.Tensor,
        repeats: int,
    ) -> ColumnLayout | None:
        """The layout of a call whose prompts' ``mask`` each stand for ``repeats`` requests;
        ``None`` where neither layout is set (the default path, which so never reads the
        prompts' padding on the host)."""
        if config.eager_layout is None:
            return None
        width = mask.shape[1]
        pads = [width - int(real) for real in mask.sum(-1).tolist() for _ in range(repeats)]
        return cls(step, table, width, pads, config.align_decode_fronts, config.trim_cache)

    def arrange(self, refilling: bool) -> int | None:
        """Before a refill: right-align every busy slot at one write column and return it for
        the newcomers (``align_decode_fronts``), or drop the leading columns no busy slot reads
        (``trim_cache``; ``None``: newcomers keep their own columns)."""
        if self.align:
            return self.align_front(refilling)
        self.trim_front()
        return None

    def place(self, slot: int, front: int) -> None:
        """Move a newcomer in ``slot`` (written at the prompts' width) to write at ``front``."""
        self.shift(slot, front - self.width)

    def narrowing(self, runner: Runner, total: int) -> Runner:
        """``runner``, each of whose steps attends over :meth:`span` only (counted)."""

        def run() -> None:
            lo, hi = self.step.span = self.span(total)
            self.attended += hi - lo
            runner()

        return run

    def finish(self, steps: int, total: int) -> float:
        """After the last step: the held step attends over every column again; the mean span
        the ``steps`` attended to."""
        self.step.span = None
        return self.attended / steps if steps else float(total)

    def span(self, total: int) -> tuple[int, int]:
        """Columns any busy slot may attend to: from the first real prompt token to the
        furthest write column (host bookkeeping, no device read)."""
        table = self.table
        busy = table.occupied()
        lo = min(table.start[i] + self.pads[table.request[i]] for i in busy)
        hi = max(table.column[i] for i in busy) + 1
        return max(lo, 0), min(hi, total - 1)

    def trim_front(self) -> None:
        """Drop the leading columns no active slot attends to (shift every active slot left):
        columns left of every row's first real prompt token (left padding, dead space)."""
        table = self.table
        busy = table.occupied()
        if not busy:
            return
        lead = min(table.start[i] + self.pads[table.request[i]] for i in busy)
        for slot in busy:
            self.shift(slot, -lead)

    def align_front(self, refilling: bool) -> int:
        """Right-align every active slot at one write column; return it for the newcomers.

        Rows only move right here, so without trimming the front never moves back; it compacts
        (drops dead leading columns) only when a row could otherwise run into the sink.
        """
        if self.trim:
            self.trim_front()
        table, width = self.table, self.width
        busy = table.occupied()
        sink = self.step.cache.max_len - 1  # host int: no device read
        max_new = (sink - width) // 2  # the buffers were sized W + 2 * max_new + 1
        front = max([table.column[i] for i in busy] + ([width] if refilling else []), default=width)
        if front + max_new >= sink:
            self.trim_front()
            front = max([table.column[i] for i in busy] + [width])
        for slot in busy:
            self.shift(slot, front - table.column[slot])
        return front

    def shift(self, slot: int, by: int) -> None:
        """Move ``slot``'s columns ``by`` places (right if positive), its table entries too."""
        shift_row(self.step, slot, by)
        self.table.start[slot] += by
        self.table.column[slot] += by
        self.table.moved_columns += abs(by)
