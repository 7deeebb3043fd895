"""Runners: what performs one decode step of a call — the eager step, a replay of the held
graph, or per-position replays — each counting what it did into the call's stats.

:func:`start_runner` is the one place a call turns its plan into a runner: it asks the process
group to agree, captures what the holder lacks, and falls back to the eager step (with the
reason in the stats) when a capture fails.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Protocol

from graphcap.errors import NonFiniteLogitsWarning
from graphcap.rollout.cache.blocks import BlockKVCache, reads_blocks
from graphcap.rollout.holder.holder import GraphHolder
from graphcap.rollout.plan.plan import Plan
from graphcap.rollout.results import RolloutStats
from graphcap.rollout.step.step import DecodeStep


class Runner(Protocol):
    def __call__(self) -> None: ...


class ReplayRunner:
    """Replays one graph per step."""

    def __init__(self, holder: GraphHolder, graph: object, stats: RolloutStats):
        self.backend, self.graph, self.stats = holder.backend, graph, stats

    def __call__(self) -> None:
        self.backend.replay_graph(self.graph)
        self.stats.replays += 1


class PositionRunner:
    """Step ``p`` replays graph ``p``, capturing it first when the holder lacks it (the capture
    leaves every buffer and the RNG as they were, so that replay performs the step). The graph
    for position ``p`` attends over the written columns ``[0, width + p + 1)`` only. After a
    failed capture the remaining steps run eagerly (the holder has the reason)."""

    def __init__(self, holder: GraphHolder, step: DecodeStep, plan: Plan, stats: RolloutStats):
        self.holder, self.eager, self.stats = holder, step, stats
        self.attention = plan.attention
        self.width = int(plan.signature.prompt_width or 0)
        self.position = 0
        self.failed = False
        stats.path, stats.attention = plan.path, plan.attention

    def __call__(self) -> None:
        position, self.position = self.position, self.position + 1
        graph = None if self.failed else self.holder.graph(position)
        if graph is None and not self.failed:
            graph = self._capture(position)
        if graph is None:
            self.eager()
            return
        self.holder.backend.replay_graph(graph)
        self.stats.replays += 1

    def _capture(self, position: int) -> object | None:
        start = time.perf_counter()
        step = self.eager.with_span((0, self.width + position + 1))
        graph = self.holder.capture(step, self.attention, self.stats, key=position)
        self.stats.capture_s += time.perf_counter() - start
        self.failed = graph is None
        if self.failed:  # the call finishes eagerly, as after a failed static capture
            self.stats.path = "eager"
            self.stats.fallback_reason = self.holder.disabled_reason
        else:
            self.stats.captured = True
        return graph


def start_runner(
    holder: GraphHolder, plan: Plan, step: DecodeStep, stats: RolloutStats, decode_steps: int
) -> Runner:
    """The runner for a call's ``decode_steps`` steps, after the group agreed on graphs.

    ``plan`` says whether this rank wants graphs; every rank calls this when graphs are enabled
    and there is a step to run, so the agreement's collectives pair up. Records the path,
    capture time and fallback reason in ``stats``.
    """
    positions = plan.path == "per_position_graph"
    missing = holder.graph_count < decode_steps if positions else holder.graph() is None
    if not holder.agree(plan.graph, missing, stats):
        return step
    if positions:
        return PositionRunner(holder, step, plan, stats)
    graph = holder.graph()
    if graph is None:
        start = time.perf_counter()
        graph = holder.capture(step, plan.attention, stats, compiled=plan.compiled)
        stats.capture_s = time.perf_counter() - start
        stats.captured = graph is not None
    if graph is None:
        stats.fallback_reason = holder.disabled_reason
        return step
    stats.path, stats.attention, stats.compiled = plan.path, plan.attention, plan.compiled
    return ReplayRunner(holder, graph, stats)


def grow_blocks(
    holder: GraphHolder,
    step: DecodeStep,
    columns: Sequence[int | None],
    ahead: int,
    stats: RolloutStats,
) -> None:
    """Hand out blocks for rows whose next write column ``columns[b]`` (host) has none, for
    ``ahead`` steps on; when the pools must grow, the graphs reading them are dropped first
    (the replacement pools are new tensors), with the reason in ``stats``."""
    cache = step.cache
    if not isinstance(cache, BlockKVCache):
        return

    def drop() -> None:
        if holder.graph_count:
            stats.recapture_reason.append(f"kv_pool_blocks (the pool of {cache.num_blocks} grew)")
            holder.drop_graphs()

    cache.assign(columns, ahead, before_growth=drop)


def record_nan_draws(stats: RolloutStats, step: DecodeStep) -> None:
    """The tokens the call sampled from NaN logits, warned about: the sampler hides a NaN (it
    must not reach ``multinomial``), and it is the one sign of a diverged policy."""
    stats.nan_draws = int(step.state.nan_draws)
    if stats.nan_draws:
        warnings.warn(
            f"{stats.nan_draws} sampled token(s) of this call were drawn for rows whose logits "
            "held NaN (the model's weights or activations have diverged?): they are uniform "
            "draws, not the model's; stats.nan_draws counts them",
            NonFiniteLogitsWarning,
            stacklevel=4,
        )


def record_kv(stats: RolloutStats, step: DecodeStep) -> None:
    """The call's K/V layout figures: layout, peak blocks held, pool growths, cache bytes."""
    cache = step.cache
    stats.kv_cache_bytes = cache.nbytes()
    if isinstance(cache, BlockKVCache):
        stats.kv_layout = "blocks"
        stats.kv_blocks_held = cache.peak_held
        stats.kv_pool_growths = cache.growths


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
        stats: RolloutStats,
        runner: Runner,
        columns: Callable[[int], Sequence[int | None]],
        ahead: int,
    ):
        self.holder, self.step, self.plan, self.stats = holder, step, plan, stats
        self.columns, self.ahead, self.done = columns, ahead, 0
        self.graph = runner.graph if isinstance(runner, ReplayRunner) else None
        caps = holder.backend.capabilities
        self.host_lengths = caps.graph_kv_lengths_on_host and reads_blocks(plan.attention)

    def __call__(self) -> None:
        columns = self.columns(self.done)
        self.done += 1
        grow_blocks(self.holder, self.step, columns, self.ahead, self.stats)
        if self.graph is not None and self.holder.graph() is None:
            start = time.perf_counter()
            self.graph = self.holder.capture(
                self.step, self.plan.attention, self.stats, compiled=self.plan.compiled
            )
            self.stats.capture_s += time.perf_counter() - start
            if self.graph is None:  # the rest of the call runs eagerly, as after any failure
                self.stats.path = "continuous_eager" if "continuous" in self.plan.path else "eager"
                self.stats.fallback_reason = self.holder.disabled_reason
        if self.graph is None:
            self.step()
            return
        if self.host_lengths:
            lengths = [1 if c is None else c + 1 for c in columns]
            self.holder.backend.update_graph_kv_lengths(self.graph, lengths)
        self.holder.backend.replay_graph(self.graph)
        self.stats.replays += 1
