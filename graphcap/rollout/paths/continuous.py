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
from graphcap.rollout.paths.ladder import CHECK_EVERY, LadderRunner, call_ladder, decode_runner
from graphcap.rollout.paths.record import Record, begin
from graphcap.rollout.paths.runners import Runner, grow_blocks, start_runner
from graphcap.rollout.plan.inputs import Call
from graphcap.rollout.prefill import Prefill, run_prefill
from graphcap.rollout.results import RolloutResult, RolloutStats, finish_details
from graphcap.rollout.sampling import RowPlan
from graphcap.rollout.settings.call import CallSettings
from graphcap.rollout.settings.rollout_config import RolloutConfig
from graphcap.rollout.step.slots import ContinuousStep, SlotTable, clear_slots, shift_row


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
    pads: list[int]  # left-pad columns per prompt (host copy, taken before decoding)
    next: int = 0

    def __post_init__(self) -> None:
        self.order = sorted(range(len(self.limits)), key=lambda r: -self.limits[r])

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
        config, holder = self.config, self.holder
        settings, generator = call.settings, call.generator
        if settings.output_scores or settings.output_logits or settings.top_logprobs:
            raise ValueError(
                "output_scores / output_logits / top_logprobs are recorded per batch row, but "
                "the continuous path reuses rows for other requests; drop "
                "RolloutConfig.continuous_batch_size for calls that need them"
            )
        slots = int(config.continuous_batch_size)
        repeats = settings.num_return_sequences
        prompts, width = call.input_ids.shape
        limits = _limits(call.request_max_new_tokens, prompts, repeats, settings)
        max_new = settings.max_new_tokens
        align, trim = config.align_decode_fronts, config.trim_cache
        # the sink column is last; aligned fronts may place a row up to max_new further right
        total = width + max_new + 1 + (max_new if align else 0)
        total = config.total_length(self.model, total, holder.backend)
        plan, record = begin(self.model, config, holder, call, slots, total)
        total = plan.signature.total_len  # whole blocks on a block table

        mask = call.attention_mask
        queue = _Queue(call.input_ids, mask, repeats, limits, (width - mask.sum(-1)).tolist())
        first = queue.take(slots)
        prefill = _prefill(self.model, queue, first)
        vocab = prefill.logits.shape[-1]
        step = holder.step_for(
            plan.signature,
            prefill.specs,
            lambda memory: ContinuousStep.build(
                self.model, prefill.specs, plan, vocab, settings, generator, memory
            ),
        )
        assert isinstance(step, ContinuousStep)
        step.state.set_stop_ids(settings.stop_ids)
        step.state.set_stop_sequences(settings.stop_sequences, settings.include_stop_str_in_output)
        step.cache.reset_for_call()
        clear_slots(step, range(slots))
        step.state.nan_draws.zero_()
        interval = config.eos_check_interval
        schedule = _Schedule(
            self.model,
            holder,
            step,
            queue,
            RowPlan.build(call.per_prompt, repeats, len(limits)),
            record,
            _Outputs.empty(
                len(limits), width, max_new, settings.pad_token_id, holder.backend.device
            ),
            SlotTable.empty(slots),
            interval,
            align,
            trim,
        )
        table = schedule.table
        schedule.fill(first, 0, prefill)
        if table.due_by(0):  # budget-1 requests are done at their first token
            schedule.service(0, read=False)
        prefill_s = time.perf_counter() - start

        runner: Runner = step
        if config.wants_graphs(holder.backend) and max_new > 1:
            runner = start_runner(holder, plan, step, record, max_new - 1)
        # the layout modes move columns under a span the eager step reads: they keep the slots
        runner = decode_runner(
            holder,
            step,
            plan,
            record,
            runner=runner,
            sizes=() if align or trim else call_ladder(config, plan, slots),
            columns=lambda _: _columns(table),
            ahead=interval,
        )
        ladder = runner if isinstance(runner, LadderRunner) else None
        t_decode = time.perf_counter()
        narrow = runner is step and (align or trim)
        attended = steps = 0
        # every request finishes within its limit and is seen within one interval after
        bound = sum(limits) + interval * (len(limits) + 1)
        while table.occupied():
            if steps > bound:
                raise DecodeStalledError(
                    f"continuous decoding ran {steps} steps, more than its {len(limits)} "
                    f"requests can take ({bound}), with requests still unfinished: the decode "
                    f"step changes nothing (on backend {holder.backend.name!r}, path "
                    f"{record.path}); run the conformance suite on this backend"
                )
            if ladder is not None and queue.empty:
                schedule.compact(ladder)
            if narrow:
                step.span = schedule.span(total)
            attended += step.span[1] - step.span[0] if narrow else total
            runner()
            steps += 1
            for slot in table.occupied():
                table.column[slot] = min(table.column[slot] + 1, total - 2)
            # on the ladder, once no request waits, the flags are read as the static path
            # reads them: each read may let the busy slots move to a smaller size
            tail = ladder is not None and queue.empty
            check = steps % (min(interval, CHECK_EVERY) if tail else interval) == 0
            if check or schedule.due(steps, ladder):
                schedule.service(steps, read=check)
        holder.backend.synchronize()
        decode_s = time.perf_counter() - t_decode
        step.span = None
        stats = record.stats(
            step,
            slots,
            total,
            steps,
            prefill_s,
            decode_s,
            slots_refilled=table.refilled,
            moved_columns=table.moved_columns,
            mean_span=attended / steps if steps else float(total),
            occupancy=_occupancy(
                schedule.outputs.response, record.row_steps if ladder is not None else slots * steps
            ),
        )
        return _result(schedule.outputs, width, settings, stats)


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
    :class:`RowPlan` by request) and the output buffers the retired requests are copied into."""

    model: torch.nn.Module
    holder: GraphHolder
    step: ContinuousStep
    queue: _Queue
    rows: RowPlan
    record: Record
    outputs: _Outputs
    table: SlotTable
    interval: int
    align: bool
    trim: bool

    def fill(
        self,
        requests: list[int],
        now: int,
        prefill: Prefill | None = None,
        front: int | None = None,
    ) -> None:
        """Put ``requests`` into free slots after decode step ``now`` (prefilled together,
        first token chosen)."""
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
        width = queue.ids.shape[1]
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
                _shift(step, table, slot, front - width)
        step.configure_rows(
            rows, [self.rows.params[r] for r in requests], [self.rows.samples[r] for r in requests]
        )
        step.commit_rows(prefill.logits[sources], rows)

    def due(self, now: int, ladder: LadderRunner | None) -> bool:
        """Whether to retire between checks: a slot's budget ran out and a queued request can
        take it, or every busy slot is done (the call ends without waiting for a check), or on
        the ladder the slots left busy fit a smaller size. With an empty queue and others still
        busy, retiring early would otherwise free nothing useful."""
        due = self.table.due_by(now)
        if not due:
            return False
        left = len(self.table.occupied()) - len(due)
        shrinks = ladder is not None and ladder.target(left) is not None
        return not self.queue.empty or not left or shrinks

    def compact(self, ladder: LadderRunner) -> None:
        """With no request waiting: when the busy slots fit a smaller size of the ladder, the
        busy ones beyond it move into free slots inside it (every per-row buffer, the cache's
        rows, the slot table's entries), the following steps run at that size, and the slots
        they left are cleared as retired ones are. Host bookkeeping, no device read."""
        table = self.table
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
            front = None
            if self.align:
                front = self.align_front(bool(requests))
            elif self.trim:
                self.trim_front()
            table.refilled += len(requests)
            self.fill(requests, now, front=front)
            done = table.due_by(now)
            if not done:
                return

    def retire(self, done: list[int]) -> None:
        """Copy the ``done`` slots' requests into the outputs and free the slots."""
        out_seq, out_resp, out_logp, out_hit = self.outputs
        table, queue = self.table, self.queue
        width, max_new = queue.ids.shape[1], out_resp.shape[1]
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

    def span(self, total: int) -> tuple[int, int]:
        """Columns any busy slot may attend to: from the first real prompt token to the
        furthest write column (host bookkeeping, no device read)."""
        table, queue = self.table, self.queue
        busy = table.occupied()
        lo = min(table.start[i] + queue.pads[queue.prompt(table.request[i])] for i in busy)
        hi = max(table.column[i] for i in busy) + 1
        return max(lo, 0), min(hi, total - 1)

    def trim_front(self) -> None:
        """Drop the leading columns no active slot attends to (shift every active slot left):
        columns left of every row's first real prompt token (left padding, dead space)."""
        table, queue = self.table, self.queue
        busy = table.occupied()
        if not busy:
            return
        lead = min(table.start[i] + queue.pads[queue.prompt(table.request[i])] for i in busy)
        for slot in busy:
            _shift(self.step, table, slot, -lead)

    def align_front(self, refilling: bool) -> int:
        """Right-align every active slot at one write column; return it for the newcomers.

        Rows only move right here, so without trimming the front never moves back; it compacts
        (drops dead leading columns) only when a row could otherwise run into the sink.
        """
        if self.trim:
            self.trim_front()
        table = self.table
        busy = table.occupied()
        width = self.queue.ids.shape[1]
        sink = self.step.cache.max_len - 1  # host int: no device read
        max_new = (sink - width) // 2  # the buffers were sized W + 2 * max_new + 1
        front = max([table.column[i] for i in busy] + ([width] if refilling else []), default=width)
        if front + max_new >= sink:
            self.trim_front()
            front = max([table.column[i] for i in busy] + [width])
        for slot in busy:
            _shift(self.step, table, slot, front - table.column[slot])
        return front


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


def _shift(step: ContinuousStep, table: SlotTable, slot: int, by: int) -> None:
    shift_row(step, slot, by)
    table.start[slot] += by
    table.column[slot] += by
    table.moved_columns += abs(by)
