"""The live-row ladder: a static call's steps run at the smallest batch size that holds the rows
still generating.

In an RL round most rows end long before the longest one, and a step costs what its batch size
costs whether its rows are live or not. At each "all finished" check the runner reads which rows
ended; when the live ones fit a smaller size of the ladder, live rows from beyond that size swap
places with ended rows inside it (every per-row buffer, and the cache's own way: the static
cache copies K/V rows, the block table swaps table rows), and the following steps replay the
graph captured for that size over the first rows of the same buffers. Each size's graph is
captured once per held signature and kept across calls. A row's tokens do not depend on where
it sits: its settings, key and buffers move with it, and a step's per-row math is the same at
every batch size. At the end the rows go back to their own places.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphcap.rollout.cache.blocks import BlockKVCache, reads_blocks
from graphcap.rollout.holder import GraphHolder
from graphcap.rollout.paths.record import Record
from graphcap.rollout.paths.runners import grow_blocks
from graphcap.rollout.plan import Plan
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


class LadderRunner:
    """Runs the current batch size's step; :meth:`check` moves to a smaller size.

    ``graph``: the full size's graph (captured by :func:`start_runner`), or ``None`` for an
    eager call, whose steps follow the same ladder eagerly (so eager and graph calls compute
    every step at the same batch size, bit for bit alike). ``width``: the prompt width, so row
    ``b`` writes column ``width + i`` at decode step ``i`` (block tables hand blocks out
    ``ahead`` steps on, for the rows the current size runs).
    """

    def __init__(
        self,
        holder: GraphHolder,
        step: DecodeStep,
        plan: Plan,
        record: Record,
        graph: object,
        sizes: tuple[int, ...],
        width: int,
        ahead: int,
    ):
        self.holder, self.full, self.plan, self.record = holder, step, plan, record
        self.sizes, self.width, self.ahead = sizes, width, ahead
        self.size = step.state.finished.shape[0]
        self.step, self.key, self.graph = step, None, graph
        self.replaying = graph is not None
        self.slots = list(range(self.size))  # the original row each slot now holds
        self.done = 0
        self.blocks = isinstance(step.cache, BlockKVCache)
        caps = holder.backend.capabilities
        self.host_lengths = caps.graph_kv_lengths_on_host and reads_blocks(plan.attention)

    def __call__(self) -> None:
        column = self.width + self.done
        self.done += 1
        if self.blocks:
            live = [column] * self.size + [None] * (len(self.slots) - self.size)
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
        if self.host_lengths:
            self.holder.backend.update_graph_kv_lengths(self.graph, [column + 1] * self.size)
        self.holder.backend.replay_graph(self.graph)
        self.record.replays += 1

    def check(self) -> bool:
        """Read the finished flags (one host read): whether every row ended; else move to the
        smallest ladder size that holds the live rows, if it is smaller than the current one."""
        finished = self.full.state.finished[: self.size].tolist()
        live = [row for row, ended in enumerate(finished) if not ended]
        if not live:
            return True
        target = min((s for s in self.sizes if len(live) <= s < self.size), default=None)
        if target is not None:
            self._shrink(finished, live, target)
        return False

    def _shrink(self, finished: list[bool], live: list[int], target: int) -> None:
        src = [row for row in live if row >= target]
        dst = [row for row, ended in enumerate(finished[:target]) if ended][: len(src)]
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
