"""The live-row ladder: a call's steps run at the smallest batch size that holds the rows still
generating.

In an RL round most rows end long before the longest one, and a step costs what its batch size
costs whether its rows are live or not. Between two steps the caller learns which rows ended
(the static path at each "all finished" check, :meth:`Ladder.check_and_shrink`; the
continuous path from its slot table once its queue is empty); when the live ones fit a smaller
size of the ladder, live rows from beyond that size swap places with ended rows inside it
(:meth:`Ladder.shrink`: every per-row buffer, and the cache's own way: the static cache
copies K/V rows, the block table swaps table rows), and the following steps replay the graph
captured for that size over the first rows of the same buffers (the step runner follows
:attr:`Ladder.size`). Each size's graph is captured once per held signature and kept across
calls. A row's tokens do not depend on where it sits: its settings, key, counters and buffers
move with it, and a step's per-row math is the same at every batch size. At the end the
static path puts the rows back in their own places; the continuous path's slot table follows
its requests instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphcap.rollout.holder.agreement import RankAgreement
from graphcap.rollout.paths.record import Record
from graphcap.rollout.plan import Plan
from graphcap.rollout.settings.rollout_config import RolloutConfig
from graphcap.rollout.step import DecodeStep

#: Steps between two reads of the finished flags on the ladder (at most ``eos_check_interval``):
#: a read costs one host synchronisation, a late move the steps of ended rows until it.
CHECK_EVERY = 4


def ladder_sizes(ladder: Sequence[int] | str | None, batch_size: int) -> tuple[int, ...]:
    """The sizes below ``batch_size`` a call may shrink to, largest first: ``"auto"`` every
    power of two and three quarters of each (…, 128, 96, 64, 48, …: a step never runs more than
    a third more rows than are live, past the first move), a tuple those of its sizes, ``None``
    none."""
    if ladder is None:
        return ()
    bits = range(batch_size.bit_length())
    auto = [1 << k for k in bits] + [3 << k for k in bits]
    sizes = auto if ladder == "auto" else ladder
    return tuple(sorted({s for s in sizes if s < batch_size}, reverse=True))


def call_ladder(config: RolloutConfig, plan: Plan, batch: int) -> tuple[int, ...]:
    """The smaller batch sizes a call of ``batch`` rows may shrink to, eager or captured (none
    where moving rows would change what a step does: the shared generator's draws,
    per-position graphs, ranks that would have to agree on every move, records of every row's
    scores at every step, the eager-only layouts that move columns under a span the step
    reads)."""
    sampler = plan.signature.sampler
    if plan.path.per_position or sampler.shared or sampler.records:
        return ()
    if config.process_group is not None or config.eager_layout is not None:
        return ()
    return ladder_sizes(config.batch_ladder, batch)


class Ladder:
    """One call's live-row ladder, the policy its decode loop reads: how often to read the
    finished flags (:meth:`check_every`), the size the live rows fit (:meth:`target`), the
    move to it (:meth:`shrink`) and the rows put back (:meth:`restore`). :attr:`size` is the
    batch size the steps run at now, which the step runner follows; ``slots[i]`` the original
    row that place ``i`` holds. Without ``sizes`` (``RolloutConfig.batch_ladder=None``, or a
    call :func:`call_ladder` keeps off it) it never moves and the flags are read every
    ``eos_check_interval`` steps, agreed over the process group.

    ``step``: the call's full-size step, whose buffers the moves swap rows of; ``record``:
    where the steps at each size and the moved rows are counted.
    """

    def __init__(
        self, sizes: tuple[int, ...], step: DecodeStep, record: Record, agreement: RankAgreement
    ):
        self.sizes, self.full, self.record, self.agreement = sizes, step, record, agreement
        self.size = step.state.finished.shape[0]
        self.slots = list(range(self.size))  # the original row each place now holds

    @classmethod
    def for_call(
        cls,
        config: RolloutConfig,
        plan: Plan,
        step: DecodeStep,
        record: Record,
        agreement: RankAgreement,
    ) -> Ladder:
        """The ladder of a call on ``step``'s rows (:func:`call_ladder` says which sizes)."""
        batch = step.state.finished.shape[0]
        return cls(call_ladder(config, plan, batch), step, record, agreement)

    @property
    def active(self) -> bool:
        """Whether the call may move to a smaller size (its steps are counted per size)."""
        return bool(self.sizes)

    def check_every(self, interval: int) -> int:
        """Steps between two reads of the finished flags: ``interval`` (the config's
        ``eos_check_interval``), at most :data:`CHECK_EVERY` on the ladder."""
        return min(interval, CHECK_EVERY) if self.sizes else interval

    def check_and_shrink(self) -> bool:
        """Read the finished flags (one host read): whether every row ended; else, on the
        ladder, move to the smallest size that holds the live rows, if it is smaller than the
        current one. Off the ladder the read is agreed over the process group."""
        if not self.sizes:
            return self.agreement.all_finished(self.full.state.all_finished)
        finished = self.full.state.finished[: self.size].tolist()
        live = finished.count(False)
        if not live:
            return True
        target = self.target(live)
        if target is not None:
            self.shrink(finished, target)
        return False

    def target(self, live: int) -> int | None:
        """The smallest ladder size that holds ``live`` rows, where it is below the current
        size (else ``None``)."""
        return min((s for s in self.sizes if live <= s < self.size), default=None)

    def ran_step(self) -> None:
        """Count one step at the current size (on the ladder only)."""
        if self.sizes:
            self.record.batch_steps[self.size] = self.record.batch_steps.get(self.size, 0) + 1
            self.record.row_steps += self.size

    def shrink(self, ended: Sequence[bool], target: int) -> list[tuple[int, int]]:
        """Run at size ``target`` from the next step: the live rows (``ended[b]`` false, for
        each row of the current size) beyond it swap places with ended rows inside it. Returns
        the ``(ended row, live row)`` pairs that swapped. Between replays only."""
        live = [row for row, gone in enumerate(ended) if not gone]
        src = [row for row in live if row >= target]
        dst = [row for row, gone in enumerate(ended[:target]) if gone][: len(src)]
        if src:
            device = self.full.state.finished.device
            as_index = torch.tensor(dst + src, dtype=torch.long).to(device)
            self.full.move_rows(as_index[: len(dst)], as_index[len(dst) :])
            for a, b in zip(dst, src, strict=True):
                self.slots[a], self.slots[b] = self.slots[b], self.slots[a]
            self.record.rows_moved += len(src)
        if self.full.cache.grows:  # ended rows beyond the new size give their blocks back
            self.full.cache.free_rows(range(target, self.size))
        self.size = target
        return list(zip(dst, src, strict=True))

    def restore(self) -> None:
        """Put every row back in its own place (the caller's order), after the last step."""
        if self.slots == sorted(self.slots):
            return
        state = self.full.state
        where = [0] * len(self.slots)
        for slot, row in enumerate(self.slots):
            where[row] = slot
        index = torch.tensor(where, dtype=torch.long).to(state.finished.device)
        for tensor in state.row_tensors():
            tensor.copy_(tensor[index])
        self.slots = list(range(len(self.slots)))
