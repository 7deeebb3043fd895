"""Runners: what performs one decode step of a call, counting what it did into the call's
record. :class:`StepRunner` replays a graph per batch size of the live-row ladder (the full
size's when the call does not move) or runs the eager step; :class:`PositionRunner` replays a
graph per decode position.

:func:`start_runner` is the one place a call turns its plan into a runner: it asks the process
group to agree and captures the full size's graph (eager steps when the group refused graphs
or a capture failed, with the reason in the record).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from graphcap.rollout.cache.blocks import reads_blocks
from graphcap.rollout.holder import FULL_STEP, GraphHolder, GraphKey
from graphcap.rollout.paths.ladder import Ladder
from graphcap.rollout.paths.record import Record
from graphcap.rollout.plan import Plan
from graphcap.rollout.step import DecodeStep


class Runner(Protocol):
    def __call__(self) -> None: ...


class StepRunner:
    """Runs a call's decode steps at the size its :class:`Ladder` runs at: a replay of the
    held graph for that size (:class:`GraphKey`; captured at the first step there), or the
    eager step where the call has no graph.

    ``graph``: the full size's graph (:func:`start_runner` captured it), or ``None`` for an
    eager call, whose steps follow the same ladder eagerly (so eager and graph calls compute
    every step at the same batch size, bit for bit alike). ``columns(i)``: each row's write
    column at the call's ``i``-th decode step, rows in their current places (host values;
    ``None`` for idle rows): a block table hands blocks out ``ahead`` steps on for the rows
    the current size runs (a growth drops the graphs, which are captured again), and a backend
    that declares ``graph_kv_lengths_on_host`` gets each replay's lengths from them
    (:func:`replay`). After a failed capture the rest of the call runs eagerly, on the same
    ladder.
    """

    def __init__(
        self,
        holder: GraphHolder,
        step: DecodeStep,
        plan: Plan,
        record: Record,
        graph: object | None,
        ladder: Ladder,
        columns: Callable[[int], Sequence[int | None]],
        ahead: int,
    ):
        self.holder, self.full, self.plan, self.record = holder, step, plan, record
        self.ladder, self.columns, self.ahead = ladder, columns, ahead
        self.step, self.key, self.graph = step, FULL_STEP, graph
        self.replaying = graph is not None
        self.size = self.batch = step.state.finished.shape[0]
        self.done = 0
        self.blocks = step.cache.grows
        self.growths = step.cache.growths if self.blocks else 0
        caps = holder.backend.capabilities
        self.host_lengths = (
            self.blocks and caps.graph_kv_lengths_on_host and reads_blocks(plan.attention)
        )

    def __call__(self) -> None:
        if self.ladder.size != self.size:
            self.follow(self.ladder.size)
        columns = list(self.columns(self.done))[: self.size] if self.blocks else []
        self.done += 1
        if self.blocks:
            live = columns + [None] * (self.batch - self.size)
            grow_blocks(self.holder, self.full, live, self.ahead, self.record)
            if self.full.cache.growths != self.growths:  # here or at a refill between steps
                self.regrown()
        if self.replaying and self.graph is None:
            # (re)captured; after a failure the rest of the call runs eagerly, on the same ladder
            self.graph = self.record.capture(self.holder, self.step, self.plan, key=self.key)
            self.replaying = self.graph is not None
        self.ladder.ran_step()
        if not self.replaying:
            self.step()
            return
        replay(self.holder, self.graph, self.record, columns if self.host_lengths else None)

    def regrown(self) -> None:
        """The block pools grew: they are new tensors, which the graphs read no more (the
        growth dropped them, :func:`grow_blocks`) and a smaller size's step views no more."""
        self.growths = self.full.cache.growths
        self.graph = None
        if self.size < self.batch:
            self.step = self.full.leading(self.size)  # views of the new pools

    def follow(self, size: int) -> None:
        """Run at ``size`` rows from this step on: the step over the leading rows, and its
        graph where one is held."""
        self.size, self.key = size, GraphKey(rows=size)
        self.step = self.full.leading(size)
        self.graph = self.holder.graph(self.key) if self.replaying else None


class PositionRunner:
    """Step ``p`` replays graph ``p``, capturing it first when the holder lacks it (the capture
    leaves every buffer and the RNG as they were, so that replay performs the step). The graph
    for position ``p`` attends over the written columns ``[0, width + p + 1)`` only. After a
    failed capture the remaining steps run eagerly (the record has the reason)."""

    def __init__(self, holder: GraphHolder, step: DecodeStep, plan: Plan, record: Record):
        self.holder, self.eager, self.plan, self.record = holder, step, plan, record
        self.width = int(plan.signature.prompt_width or 0)
        self.position = 0
        self.failed = False
        record.replaying(plan)

    def __call__(self) -> None:
        position, self.position = self.position, self.position + 1
        key = GraphKey(position=position)
        graph = None if self.failed else self.holder.graph(key)
        if graph is None and not self.failed:
            step = self.eager.with_span((0, self.width + position + 1))
            graph = self.record.capture(self.holder, step, self.plan, key=key)
            self.failed = graph is None  # the call finishes eagerly, as after a failed capture
        if graph is None:
            self.eager()
            return
        self.holder.backend.replay_graph(graph)
        self.record.replays += 1


def start_runner(
    holder: GraphHolder,
    step: DecodeStep,
    plan: Plan,
    record: Record,
    *,
    graphs: bool,
    decode_steps: int,
    ladder: Ladder,
    columns: Callable[[int], Sequence[int | None]],
    ahead: int,
) -> Runner:
    """What runs a call's ``decode_steps`` steps on ``ladder`` (``columns`` and ``ahead`` as
    :class:`StepRunner` takes them).

    With ``graphs`` (the engine plans graph paths on this backend) and a step to run, the
    process group agrees first: every rank calls this then, so the agreement's collectives pair
    up, and the record gets the path, capture time and fallback reason. Per-position graphs
    get their own runner; every other call a :class:`StepRunner` on the full size's graph
    (captured first when the holder lacks it), or on eager steps where the group refused
    graphs or the capture failed.
    """
    graph = None
    if graphs and decode_steps > 0:
        positions = plan.path.per_position
        missing = holder.graph_count < decode_steps if positions else holder.graph() is None
        if record.agree(holder, plan, missing):
            if positions:
                return PositionRunner(holder, step, plan, record)
            graph = full_graph(holder, step, plan, record)
    return StepRunner(holder, step, plan, record, graph, ladder, columns, ahead)


def full_graph(holder: GraphHolder, step: DecodeStep, plan: Plan, record: Record) -> object | None:
    """The held full-size graph, captured first when the holder lacks it; ``None`` (eager
    steps) when the capture failed."""
    graph = holder.graph()
    if graph is None:
        graph = record.capture(holder, step, plan)
    if graph is not None:
        record.replaying(plan)
    return graph


def grow_blocks(
    holder: GraphHolder,
    step: DecodeStep,
    columns: Sequence[int | None],
    ahead: int,
    record: Record,
) -> None:
    """Hand out blocks for rows whose next write column ``columns[b]`` (host) has none, for
    ``ahead`` steps on; when the pools must grow, the graphs reading them are dropped first
    (the replacement pools are new tensors), with the reason in the ``record``."""
    cache = step.cache
    if not cache.grows:
        return

    def drop() -> None:
        if holder.graph_count:
            record.recapture_reason.append(f"kv_pool_blocks (the pool of {cache.num_blocks} grew)")
            holder.drop_graphs()

    cache.assign(columns, ahead, before_growth=drop)


def replay(
    holder: GraphHolder,
    graph: object,
    record: Record,
    columns: Sequence[int | None] | None,
) -> None:
    """Replay ``graph``, after handing a backend that takes the kernel's lengths on the host
    each row's (``columns`` given: ``columns + 1``, idle rows 1, the values the step sets on
    the device)."""
    if columns is not None:
        lengths = [1 if c is None else c + 1 for c in columns]
        holder.backend.update_graph_kv_lengths(graph, lengths)
    holder.backend.replay_graph(graph)
    record.replays += 1
