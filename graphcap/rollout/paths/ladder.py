"""The live-row ladder: a call's steps run at the smallest batch size that holds the rows still
generating.

In an RL round most rows end long before the longest one, and a step costs what its batch size
costs whether its rows are live or not. Between two steps the caller learns which rows ended
(the static path at each "all finished" check, :meth:`LadderRunner.check_and_shrink`; the
continuous path from its slot table once its queue is empty); when the live ones fit a smaller
size of the ladder, live rows from beyond that size swap places with ended rows inside it
(:meth:`LadderRunner.shrink`: every per-row buffer, and the cache's own way: the static cache
copies K/V rows, the block table swaps table rows), and the following steps replay the graph
captured for that size over the first rows of the same buffers. Each size's graph is captured
once per held signature and kept across calls. A row's tokens do not depend on where it sits:
its settings, key, counters and buffers move with it, and a step's per-row math is the same at
every batch size. At the end the static path puts the rows back in their own places; the
continuous path's slot table follows its requests instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from graphcap.rollout.holder import GraphHolder
from graphcap.rollout.paths.record import Record
from graphcap.rollout.paths.runners import BlockRunner, ReplayRunner, Runner, grow_blocks, replay
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
    scores at every step)."""
    sampler = plan.signature.sampler
    if plan.path.per_position or sampler.shared or sampler.records:
        return ()
    if config.process_group is not None:
        return ()
    return ladder_sizes(config.batch_ladder, batch)


def decode_runner(
    holder: GraphHolder,
    step: DecodeStep,
    plan: Plan,
    record: Record,
    *,
    runner: Runner,
    sizes: tuple[int, ...],
    columns: Callable[[int], Sequence[int | None]],
    ahead: int,
) -> Runner:
    """What runs a call's decode steps, around ``runner`` (the eager step or the full size's
    replay): the ladder's runner where ``sizes`` is not empty, else on a block table a runner
    that hands blocks out between steps, else ``runner`` itself. ``columns(i)``: each row's
    write column at the call's ``i``-th decode step, in the rows' current places (host values;
    ``None`` for idle rows)."""
    blocks = BlockRunner(holder, step, plan, record, runner, columns, ahead)
    if sizes and (runner is step or isinstance(runner, ReplayRunner)):
        return LadderRunner(blocks, sizes)
    return blocks if step.cache.grows else runner


class LadderRunner:
    """Runs the current batch size's step; :meth:`shrink` moves to a smaller size.

    ``base``: the call's runner off the ladder, whose settings this one takes: the full
    size's graph (captured by :func:`start_runner`), or ``None`` for an eager call, whose
    steps follow the same ladder eagerly (so eager and graph calls compute every step at the
    same batch size, bit for bit alike); ``columns(i)``, each row's write column at the call's
    ``i``-th decode step, rows in their current places (``None`` for idle rows): block tables
    hand blocks out ``ahead`` steps on for the rows the current size runs, and a backend taking
    the kernel's lengths on the host gets them from it.
    """

    def __init__(self, base: BlockRunner, sizes: tuple[int, ...]):
        self.holder, self.full, self.plan = base.holder, base.step, base.plan
        self.record = base.record
        self.columns, self.ahead, self.host_lengths = base.columns, base.ahead, base.host_lengths
        self.sizes, self.size = sizes, base.step.state.finished.shape[0]
        self.step, self.key, self.graph = base.step, None, base.graph
        self.replaying = self.graph is not None
        self.slots = list(range(self.size))  # the original row each slot now holds
        self.done = 0
        self.blocks = self.full.cache.grows
        self.reads_columns = self.blocks or self.host_lengths  # else no host list a step

    def __call__(self) -> None:
        columns = list(self.columns(self.done))[: self.size] if self.reads_columns else []
        self.done += 1
        if self.blocks:
            live = columns + [None] * (len(self.slots) - self.size)
            growths = self.full.cache.growths
            grow_blocks(self.holder, self.full, live, self.ahead, self.record)
            if self.full.cache.growths != growths and self.key is not None:
                self.step = self.full.leading(self.size)  # views of the new pools
        if self.replaying and (self.graph is None or self.holder.graph(self.key) is None):
            # after a failure the rest of the call runs eagerly, on the same ladder
            self.graph = self.record.capture(self.holder, self.step, self.plan, key=self.key)
            self.replaying = self.graph is not None
        self.record.batch_steps[self.size] = self.record.batch_steps.get(self.size, 0) + 1
        self.record.row_steps += self.size
        if not self.replaying:
            self.step()
            return
        replay(self.holder, self.graph, self.record, columns if self.host_lengths else None)

    def check_and_shrink(self) -> bool:
        """Read the finished flags (one host read): whether every row ended; else move to the
        smallest ladder size that holds the live rows, if it is smaller than the current one."""
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
        if self.blocks:  # ended rows beyond the new size give their blocks back
            self.full.cache.free_rows(range(target, self.size))
        self.size, self.key = target, ("rows", target)
        self.step = self.full.leading(target)
        self.graph = self.holder.graph(self.key) if self.replaying else None
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
