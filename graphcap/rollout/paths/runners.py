"""Runners: what performs one decode step of a call — the eager step, a replay of the held
graph, or per-position replays — each counting what it did into the call's record.

:func:`start_runner` is the one place a call turns its plan into a runner: it asks the process
group to agree, and :data:`RUNNERS` names the runner serving the plan's path (eager steps when
the group refused graphs or a capture failed, with the reason in the record).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from graphcap.rollout.cache.blocks import reads_blocks
from graphcap.rollout.holder import GraphHolder
from graphcap.rollout.paths.record import Record
from graphcap.rollout.plan import Path, Plan
from graphcap.rollout.step import DecodeStep


class Runner(Protocol):
    def __call__(self) -> None: ...


class ReplayRunner:
    """Replays one graph per step."""

    def __init__(self, holder: GraphHolder, graph: object, record: Record):
        self.backend, self.graph, self.record = holder.backend, graph, record

    def __call__(self) -> None:
        self.backend.replay_graph(self.graph)
        self.record.replays += 1

    @classmethod
    def start(cls, holder: GraphHolder, step: DecodeStep, plan: Plan, record: Record) -> Runner:
        """Replay the held graph, captured first when the holder lacks it (eager steps when
        the capture failed)."""
        graph = holder.graph()
        if graph is None:
            graph = record.capture(holder, step, plan)
        if graph is None:
            return step
        record.replaying(plan)
        return cls(holder, graph, record)


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
        graph = None if self.failed else self.holder.graph(position)
        if graph is None and not self.failed:
            step = self.eager.with_span((0, self.width + position + 1))
            graph = self.record.capture(self.holder, step, self.plan, key=position)
            self.failed = graph is None  # the call finishes eagerly, as after a failed capture
        if graph is None:
            self.eager()
            return
        self.holder.backend.replay_graph(graph)
        self.record.replays += 1

    @classmethod
    def start(cls, holder: GraphHolder, step: DecodeStep, plan: Plan, record: Record) -> Runner:
        """Per-position graphs, each captured at its first step."""
        return cls(holder, step, plan, record)


#: The runner serving each graph path (an eager path's runner is the step itself).
RUNNERS: dict[Path, type[ReplayRunner] | type[PositionRunner]] = {
    Path.STATIC_GRAPH: ReplayRunner,
    Path.CONTINUOUS_GRAPH: ReplayRunner,
    Path.PER_POSITION_GRAPH: PositionRunner,
}


def start_runner(
    holder: GraphHolder, plan: Plan, step: DecodeStep, record: Record, decode_steps: int
) -> Runner:
    """The runner for a call's ``decode_steps`` steps, after the group agreed on graphs.

    ``plan`` says whether this rank wants graphs; every rank calls this when graphs are enabled
    and there is a step to run, so the agreement's collectives pair up. The record gets the
    path, capture time and fallback reason.
    """
    positions = plan.path.per_position
    missing = holder.graph_count < decode_steps if positions else holder.graph() is None
    if not record.agree(holder, plan, missing):
        return step
    return RUNNERS[plan.path].start(holder, step, plan, record)


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


class BlockRunner:
    """Runs a block-table step (eagerly or by replay), growing the table ahead between steps.

    ``columns(i)``: each row's write column at the call's ``i``-th decode step (host values;
    ``None`` for idle rows). When a growth dropped the graph, the step is captured again. On a
    backend that declares ``graph_kv_lengths_on_host``, a replay of a block-aware attention is
    preceded by :meth:`Backend.update_graph_kv_lengths` with the lengths the step sets on the
    device (``columns + 1``, idle rows 1).
    """

    def __init__(
        self,
        holder: GraphHolder,
        step: DecodeStep,
        plan: Plan,
        record: Record,
        runner: Runner,
        columns: Callable[[int], Sequence[int | None]],
        ahead: int,
    ):
        self.holder, self.step, self.plan, self.record = holder, step, plan, record
        self.columns, self.ahead, self.done = columns, ahead, 0
        self.graph = runner.graph if isinstance(runner, ReplayRunner) else None
        caps = holder.backend.capabilities
        self.host_lengths = caps.graph_kv_lengths_on_host and reads_blocks(plan.attention)

    def __call__(self) -> None:
        columns = self.columns(self.done)
        self.done += 1
        grow_blocks(self.holder, self.step, columns, self.ahead, self.record)
        if self.graph is not None and self.holder.graph() is None:
            # recaptured; after a failure the rest of the call runs eagerly
            self.graph = self.record.capture(self.holder, self.step, self.plan)
        if self.graph is None:
            self.step()
            return
        replay(self.holder, self.graph, self.record, columns if self.host_lengths else None)


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
