"""Continuous batching: a queue of requests through a fixed number of slots (docs/continuous.md).

While requests wait, the decode step runs over all ``N`` slots, so a captured graph sees one
batch shape and one set of tensor addresses. The queue runs longest budget first (results
still come back in request order). A request that uses its whole budget finishes at a step
the host computes, so its slot is retired and refilled right after that step, without a device
read; one that stops early (EOS, stop token) is seen every ``eos_check_interval`` steps, when
the host reads the slots' device ``finished`` flags (the only device read while decoding).
Retiring copies the request's rows out and clears the slot; refilling prefills queued requests
eagerly, writes their K/V into the slot's cache row and chooses their first token by the same
commit math. Graph and eager loops share this schedule, so they differ only in the kernels the
step runs (bit-identical where both run the same attention; docs/continuous.md). Once the
queue is empty the busy slots follow the live-row ladder (:mod:`graphcap.rollout.paths.ladder`):
when they fit a smaller size they move to the leading slots and the steps run at that size.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from graphcap.errors import DecodeStalledError
from graphcap.rollout.holder import GraphHolder
from graphcap.rollout.paths.ladder import Ladder
from graphcap.rollout.paths.layouts import ColumnLayout, extra_columns
from graphcap.rollout.paths.record import Record, begin
from graphcap.rollout.paths.runners import Runner, grow_blocks, start_runner
from graphcap.rollout.plan import Plan
from graphcap.rollout.plan.inputs import Call
from graphcap.rollout.prefill import Prefill, run_prefill
from graphcap.rollout.results import RolloutResult, RolloutStats, finish_details
from graphcap.rollout.sampling import RowPlan
from graphcap.rollout.settings.call import CallSettings
from graphcap.rollout.settings.rollout_config import RolloutConfig
from graphcap.rollout.step.slots import ContinuousStep, SlotTable, clear_slots


@dataclass
class _Queue:
    """The requests of one call: request ``r`` is sample ``r % repeats`` of prompt
    ``r // repeats``. They are taken longest budget first (stable, so a prompt's samples stay
    together): the long ones start early and the short ones fill the gaps, which keeps the
    tail after the queue empties short (docs/continuous.md, "Occupancy")."""

    ids: torch.Tensor  # (P, W) prompts
    mask: torch.Tensor  # (P, W)
    repeats: int
    limits: list[int]  # per request
    next: int = 0

    def __post_init__(self) -> None:
        self.order = sorted(range(len(self.limits)), key=lambda r: -self.limits[r])

    @classmethod
    def of(cls, call: Call) -> _Queue:
        """The call's requests: each prompt row ``num_return_sequences`` times."""
        settings, ids = call.settings, call.input_ids
        repeats = settings.num_return_sequences
        limits = _limits(call.request_max_new_tokens, ids.shape[0], repeats, settings)
        return cls(ids, call.attention_mask, repeats, limits)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def prompt(self, request: int) -> int:
        return request // self.repeats

    def take(self, count: int) -> list[int]:
        taken = self.order[self.next : self.next + count]
        self.next += len(taken)
        return taken

    @property
    def empty(self) -> bool:
        return self.next >= len(self.limits)


class ContinuousRollout:
    """The continuous path of one engine: a scheduler on the engine's holder and runners. It
    keeps nothing of a call: each call's queue, slots and outputs are its :class:`_Schedule`."""

    def __init__(self, model: torch.nn.Module, config: RolloutConfig, holder: GraphHolder):
        self.model, self.config, self.holder = model, config, holder

    def run(self, call: Call, start: float) -> RolloutResult:
        """Run the call's rows (x samples) through the slots; results in request order."""
        config, holder, settings = self.config, self.holder, call.settings
        _check_no_records(settings)
        slots, max_new = int(config.continuous_batch_size), settings.max_new_tokens
        queue = _Queue.of(call)
        width = queue.width
        # the sink column is last
        total = width + max_new + 1 + extra_columns(config, max_new)
        total = config.total_length(self.model, total, holder.backend)
        plan, record = begin(self.model, config, holder, call, slots, total)
        total = plan.signature.total_len  # whole blocks on a block table

        first = queue.take(slots)
        prefill = _prefill(self.model, queue, first)
        step = self._step(call, plan, prefill)
        table = SlotTable.empty(slots)
        requests = len(queue.limits)
        schedule = _Schedule(
            self.model,
            holder,
            step,
            queue,
            RowPlan.build(call.per_prompt, queue.repeats, requests),
            record,
            _Outputs.empty(requests, width, max_new, settings.pad_token_id, holder.backend.device),
            table,
            config.eos_check_interval,
            total,
            Ladder.for_call(config, plan, step, record, holder.agreement),
            ColumnLayout.for_call(config, step, table, queue.mask, queue.repeats),
        )
        schedule.start(first, prefill)
        prefill_s = time.perf_counter() - start

        runner = start_runner(
            holder,
            step,
            plan,
            record,
            graphs=config.wants_graphs(holder.backend),
            decode_steps=max_new - 1,
            ladder=schedule.ladder,
            columns=lambda _: _columns(table),
            ahead=schedule.interval,
        )
        layout = schedule.layout
        if layout is not None:
            runner = layout.narrowing(runner, total)
        t_decode, captured_s = time.perf_counter(), record.capture_s
        steps = schedule.decode(runner)
        holder.backend.synchronize()
        # captures taken inside the loop (the ladder's sizes, after a pool growth) count once
        decode_s = time.perf_counter() - t_decode - (record.capture_s - captured_s)
        computed = record.row_steps if schedule.ladder.active else slots * steps
        stats = record.stats(
            step,
            slots,
            total,
            steps,
            prefill_s,
            decode_s,
            slots_refilled=table.refilled,
            moved_columns=table.moved_columns,
            mean_span=float(total) if layout is None else layout.finish(steps, total),
            occupancy=_occupancy(schedule.outputs.response, computed),
        )
        return _result(schedule.outputs, width, settings, stats)

    def _step(self, call: Call, plan: Plan, prefill: Prefill) -> ContinuousStep:
        """The held step of the call's signature, its slots cleared and the call's stop
        conditions set."""
        settings = call.settings
        vocab = prefill.logits.shape[-1]
        step = self.holder.step_for(
            plan.signature,
            prefill.specs,
            lambda memory: ContinuousStep.build(
                self.model, prefill.specs, plan, vocab, settings, call.generator, memory
            ),
        )
        assert isinstance(step, ContinuousStep)
        step.state.set_stop_ids(settings.stop_ids)
        step.state.set_stop_sequences(settings.stop_sequences, settings.include_stop_str_in_output)
        step.cache.reset_for_call()
        clear_slots(step, range(step.state.finished.shape[0]))
        step.state.nan_draws.zero_()
        return step


class _Outputs(NamedTuple):
    """The call's output buffers, in request order, which retired requests are copied into."""

    sequences: torch.Tensor
    response: torch.Tensor
    logprobs: torch.Tensor
    stop_hit: torch.Tensor  # the matched stop sequence (-1: none)

    @classmethod
    def empty(cls, rows: int, width: int, max_new: int, pad: int, device: torch.device) -> _Outputs:
        return cls(
            torch.full((rows, width + max_new), pad, device=device),
            torch.zeros((rows, max_new), dtype=torch.bool, device=device),
            torch.zeros((rows, max_new), dtype=torch.float32, device=device),
            torch.full((rows,), -1, dtype=torch.long, device=device),
        )


@dataclass
class _Schedule:
    """One call on the slots: its queue, the slot table, the requests' settings (``rows``, a
    :class:`RowPlan` by request), the output buffers the retired requests are copied into, the
    live-row ladder it follows once the queue is empty, and its eager-only column layout
    (``None`` on the default path)."""

    model: torch.nn.Module
    holder: GraphHolder
    step: ContinuousStep
    queue: _Queue
    rows: RowPlan
    record: Record
    outputs: _Outputs
    table: SlotTable
    interval: int
    total: int
    ladder: Ladder
    layout: ColumnLayout | None

    def start(self, first: list[int], prefill: Prefill) -> None:
        """Put the ``first`` requests (prefilled) into the slots; those of budget 1 are done at
        their first token, so their slots are retired and refilled at once."""
        self.fill(first, 0, prefill)
        if self.table.due_by(0):
            self.service(0, read=False)

    def decode(self, runner: Runner) -> int:
        """Run decode steps until every request is retired; the steps run."""
        steps, bound = 0, self.step_bound()
        while self.table.occupied():
            if steps > bound:
                raise self.stalled(steps, bound)
            if self.queue.empty:
                self.compact()
            runner()
            steps += 1
            self.advance_columns()
            check = self.check_due(steps)
            if check or self.due(steps):
                self.service(steps, read=check)
        return steps

    def step_bound(self) -> int:
        """The most steps the call can take: every request finishes within its limit and is
        seen within one interval after."""
        return sum(self.queue.limits) + self.interval * (len(self.queue.limits) + 1)

    def stalled(self, steps: int, bound: int) -> DecodeStalledError:
        """The error of a call that ran more steps than its requests can take."""
        return DecodeStalledError(
            f"continuous decoding ran {steps} steps, more than its {len(self.queue.limits)} "
            f"requests can take ({bound}), with requests still unfinished: the decode "
            f"step changes nothing (on backend {self.holder.backend.name!r}, path "
            f"{self.record.path}); run the conformance suite on this backend"
        )

    def advance_columns(self) -> None:
        """Each busy slot writes one column further (host bookkeeping; the sink column stays
        last)."""
        table = self.table
        for slot in table.occupied():
            table.column[slot] = min(table.column[slot] + 1, self.total - 2)

    def check_due(self, now: int) -> bool:
        """Whether to read the slots' finished flags after decode step ``now``: every
        ``interval`` steps; on the ladder, once no request waits, as often as the static path
        reads them (each read may let the busy slots move to a smaller size)."""
        every = self.ladder.check_every(self.interval) if self.queue.empty else self.interval
        return now % every == 0

    def fill(
        self,
        requests: list[int],
        now: int,
        prefill: Prefill | None = None,
        front: int | None = None,
    ) -> None:
        """Put ``requests`` into free slots after decode step ``now`` (prefilled together,
        first token chosen); with ``front`` (aligned layout) they write at that column."""
        if not requests:
            return
        step, table, queue = self.step, self.table, self.queue
        if prefill is None:
            prefill = _prefill(self.model, queue, requests)
        free = table.free()[: len(requests)]
        device = step.state.finished.device
        rows = torch.tensor(free, dtype=torch.long, device=device)
        prompts = [queue.prompt(r) for r in requests]
        # each slot copies its prompt's prefill row (a prompt's samples share one prefill)
        sources = torch.tensor(
            [list(dict.fromkeys(prompts)).index(p) for p in prompts], device=device
        )
        width = queue.width
        s = step.state
        if step.cache.grows:
            columns = [width if slot in free else None for slot in range(len(table.request))]
            grow_blocks(self.holder, step, columns, self.interval, self.record)
            step.reach[rows] = width
        step.cache.load_prefill(prefill.cache, rows=rows, source_rows=sources)
        step.masks.reset(queue.mask[prompts], rows=rows)
        s.sequences[rows, :width] = queue.ids[prompts]
        s.positions[rows] = prefill.next_positions[sources].view(-1, 1)
        s.finished[rows] = False
        s.generated[rows] = 0
        step.limits[rows] = torch.tensor(
            [queue.limits[r] for r in requests], dtype=torch.long, device=device
        )
        for slot, request in zip(free, requests, strict=True):
            table.request[slot] = request
            table.start[slot] = 0
            table.column[slot] = width
            table.due[slot] = now + queue.limits[request] - 1  # the first token is chosen here
            if front is not None:
                self.layout.place(slot, front)
        step.configure_rows(
            rows, [self.rows.params[r] for r in requests], [self.rows.samples[r] for r in requests]
        )
        step.commit_rows(prefill.logits[sources], rows)

    def due(self, now: int) -> bool:
        """Whether to retire between checks: a slot's budget ran out and a queued request can
        take it, or every busy slot is done (the call ends without waiting for a check), or on
        the ladder the slots left busy fit a smaller size. With an empty queue and others still
        busy, retiring early would otherwise free nothing useful."""
        due = self.table.due_by(now)
        if not due:
            return False
        left = len(self.table.occupied()) - len(due)
        shrinks = self.ladder.target(left) is not None
        return not self.queue.empty or not left or shrinks

    def compact(self) -> None:
        """With no request waiting: when the busy slots fit a smaller size of the ladder, the
        busy ones beyond it move into free slots inside it (every per-row buffer, the cache's
        rows, the slot table's entries), the following steps run at that size, and the slots
        they left are cleared as retired ones are. Host bookkeeping, no device read."""
        table, ladder = self.table, self.ladder
        target = ladder.target(len(table.occupied()))
        if target is None:
            return
        free = [request < 0 for request in table.request[: ladder.size]]
        moved = ladder.shrink(free, target)
        for dst, src in moved:
            table.swap(dst, src)
        if moved:
            clear_slots(self.step, [src for _, src in moved])

    def service(self, now: int, read: bool) -> None:
        """Retire finished slots after decode step ``now``, then refill them from the queue.

        Slots whose budget ran out are known on the host; with ``read`` (the refill check) the
        device ``finished`` flags add those stopped early. Requests of budget 1 are done at their
        first token, so their slots are retired and refilled again at once.
        """
        table = self.table
        done = table.due_by(now)
        if read:
            # the one device read of the check; agreed over a process group (a row retires once
            # it is finished on every rank, so on the same step everywhere)
            finished = self.holder.agreement.finished_rows(self.step.state.finished)
            done = [i for i in table.occupied() if finished[i] or i in done]
        while True:
            if done:
                self.retire(done)
            requests = self.queue.take(len(table.free()))
            front = None if self.layout is None else self.layout.arrange(bool(requests))
            table.refilled += len(requests)
            self.fill(requests, now, front=front)
            done = table.due_by(now)
            if not done:
                return

    def retire(self, done: list[int]) -> None:
        """Copy the ``done`` slots' requests into the outputs and free the slots."""
        out_seq, out_resp, out_logp, out_hit = self.outputs
        table, queue = self.table, self.queue
        width, max_new = queue.width, out_resp.shape[1]
        s = self.step.state
        for slot in done:
            request = table.request[slot]
            first = table.start[slot] + width  # the first response column (start may be < 0
            # once trimming dropped left padding; the prompt comes from the queue)
            out_seq[request, :width] = queue.ids[queue.prompt(request)]
            out_seq[request, width:] = s.sequences[slot, first : first + max_new]
            out_resp[request] = s.response[slot, first : first + max_new]
            out_logp[request] = s.logprobs[slot, first : first + max_new]
            if s.stop_hit is not None:
                out_hit[request] = s.stop_hit[slot]
            table.request[slot] = -1
            table.start[slot] = 0
        clear_slots(self.step, done)


def _check_no_records(settings: CallSettings) -> None:
    if settings.output_scores or settings.output_logits or settings.top_logprobs:
        raise ValueError(
            "output_scores / output_logits / top_logprobs are recorded per batch row, but "
            "the continuous path reuses rows for other requests; drop "
            "RolloutConfig.continuous_batch_size for calls that need them"
        )


def _prefill(model: torch.nn.Module, queue: _Queue, requests: list[int]) -> Prefill:
    """One prefill row per distinct prompt among ``requests``, in first-seen order."""
    prompts = list(dict.fromkeys(queue.prompt(r) for r in requests))
    return run_prefill(model, queue.ids[prompts], queue.mask[prompts])


def _result(
    outputs: _Outputs,
    width: int,
    settings: CallSettings,
    stats: RolloutStats,
) -> RolloutResult:
    out_seq, out_resp, out_logp, out_hit = outputs
    lengths = out_resp.sum(-1)
    last = (lengths - 1).clamp(min=0)
    last_token = out_seq[:, width:].gather(1, last[:, None]).squeeze(1)
    stop_ids = torch.tensor(settings.stop_ids, dtype=torch.long, device=out_seq.device)
    stopped = ((last_token[:, None] == stop_ids).any(-1) & (lengths > 0)).tolist()
    reasons, stops, matched = finish_details(
        out_seq,
        out_resp.to(torch.long),
        stopped,
        settings.eos_ids,
        out_hit.tolist(),
        settings.stop_sequences,
    )
    return RolloutResult(
        sequences=out_seq,
        response_mask=out_resp.to(torch.long),
        response_lengths=lengths,
        finish_reasons=reasons,
        logprobs=out_logp if settings.return_logprobs else None,
        stats=stats,
        stop_token_ids=stops,
        stop_sequences=matched,
    )


def _occupancy(response: torch.Tensor, computed: int) -> float:
    """The share of the ``computed`` slot-steps (slots x steps, or on the live-row ladder the
    rows its steps ran) that produced a token (each request's first token is the prefill's)."""
    useful = int((response.sum(-1) - 1).clamp(min=0).sum())
    return useful / computed if computed else 1.0


def _limits(
    per_request: Sequence[int] | None, prompts: int, repeats: int, settings: CallSettings
) -> list[int]:
    """Each request's own max_new_tokens (default: the sampling settings' for every one)."""
    if per_request is None:
        return [settings.max_new_tokens] * (prompts * repeats)
    values = [int(v) for v in per_request]
    if len(values) != prompts:
        raise ValueError(
            f"request_max_new_tokens has {len(values)} entries for {prompts} prompts; give one "
            "per prompt row"
        )
    bad = [v for v in values if not 1 <= v <= settings.max_new_tokens]
    if bad:
        raise ValueError(
            f"request_max_new_tokens values must be in [1, max_new_tokens="
            f"{settings.max_new_tokens}] (max_new_tokens sizes the cache), got {bad[:5]}"
        )
    return [v for v in values for _ in range(repeats)]


def _columns(table: SlotTable) -> list[int | None]:
    """Each slot's write column of the next step (host bookkeeping), ``None`` for free slots."""
    return [c if r >= 0 else None for r, c in zip(table.request, table.column, strict=True)]
