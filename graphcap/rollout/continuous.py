"""Continuous batching: a queue of requests through a fixed number of slots (docs/continuous.md).

The decode step always runs over all ``N`` slots, so a captured graph sees one batch shape and
one set of tensor addresses. Every ``eos_check_interval`` steps the host reads the slots'
device ``finished`` flags (the only device read while decoding), copies finished requests'
rows out, clears those slots and refills them with queued requests (prefilled eagerly, their
K/V written into the slot's cache row, their first token chosen by the same commit math).
Graph and eager loops share this schedule, so they produce the same tokens bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from graphcap.rollout.agreement import PEER_RECAPTURE
from graphcap.rollout.cache import StaticKVCache
from graphcap.rollout.masks import MaskBuffers
from graphcap.rollout.results import RolloutResult, RolloutStats
from graphcap.rollout.signature import GraphSignature, model_dtype
from graphcap.rollout.slots import (
    ContinuousStep,
    SlotTable,
    allocate_state,
    clear_slots,
    shift_row,
)

if TYPE_CHECKING:
    from graphcap.rollout.config import SamplingParams
    from graphcap.rollout.engine import RolloutEngine


@dataclass(frozen=True)
class ContinuousSignature:
    """The static path's signature (``batch_size`` = slot capacity) plus the prompt width."""

    graph: GraphSignature
    prompt_width: int

    def differences(self, other: ContinuousSignature) -> list[str]:
        names = self.graph.differences(other.graph)
        return names + (["prompt_width"] if self.prompt_width != other.prompt_width else [])


@dataclass
class _Held:
    """Buffers and graph of one continuous signature (dropped together)."""

    signature: ContinuousSignature
    cache: StaticKVCache
    masks: MaskBuffers
    step: ContinuousStep
    generator: torch.Generator | None
    graph: object | None = None


@dataclass
class _Queue:
    """The requests of one call, in request order."""

    ids: torch.Tensor  # (R, W)
    mask: torch.Tensor  # (R, W)
    limits: list[int]
    pads: list[int]  # left-pad columns per request (host copy, taken before decoding)
    next: int = 0

    def take(self, count: int) -> list[int]:
        taken = list(range(self.next, min(self.next + count, len(self.limits))))
        self.next += len(taken)
        return taken

    @property
    def empty(self) -> bool:
        return self.next >= len(self.limits)


def graph_eligibility(params: SamplingParams) -> str | None:
    """Why this request must use the eager continuous loop, or ``None``."""
    if params.do_sample:
        return "continuous graph path is greedy only (do_sample=True runs the eager loop)"
    if params.num_return_sequences != 1:
        return "continuous graph path serves one sample per prompt"
    return None


class ContinuousRunner:
    """The continuous path of one :class:`RolloutEngine`; keeps its graph across calls."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._held: _Held | None = None
        #: cache columns moved by aligned fronts / trimming in the last call (0 on the graph path)
        self.moved_columns = 0
        #: cache columns the last call's steps attended over, on average (the buffer length
        #: unless a layout mode narrowed the span)
        self.mean_span = 0.0

    # ---- public ---------------------------------------------------------------------------
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        request_max_new_tokens: Sequence[int] | None,
        start: float,
    ) -> RolloutResult:
        """Run the call's rows (x samples) through the slots; results in request order."""
        engine, config = self.engine, self.engine.config
        stats = RolloutStats(path="continuous_eager")
        slots = int(config.continuous_batch_size)
        repeats = params.num_return_sequences
        ids = input_ids.repeat_interleave(repeats, dim=0)
        mask = attention_mask.repeat_interleave(repeats, dim=0)
        limits = _limits(request_max_new_tokens, input_ids.shape[0], repeats, params)
        width, max_new = ids.shape[1], params.max_new_tokens
        align, trim = config.align_decode_fronts, config.trim_cache
        # the sink column is last; aligned fronts may place a row up to max_new further right
        total = width + max_new + 1 + (max_new if align else 0)

        reason, windows, base = engine._graph_plan(
            params, generator, slots, total, refusal=graph_eligibility(params)
        )
        stats.fallback_reason = reason
        use_graph = bool(config.enable_graph_capture) and reason is None
        signature = ContinuousSignature(base, width)
        if self._held is not None and self._held.signature != signature:
            stats.recapture_reason = self._held.signature.differences(signature)
            self.drop()
        stats.batch_size, stats.total_len = slots, total

        queue = _Queue(ids, mask, limits, (width - mask.sum(-1)).tolist())
        rows = len(limits)
        device = engine.backend.device
        out_seq = torch.full((rows, width + max_new), int(params.pad_token_id), device=device)
        out_resp = torch.zeros((rows, max_new), dtype=torch.bool, device=device)
        out_logp = torch.zeros((rows, max_new), dtype=torch.float32, device=device)
        table = SlotTable.empty(slots)
        with torch.no_grad():
            first = queue.take(slots)
            prefill, logits, next_pos = engine._prefill(ids[first], mask[first])
            held = self._resources(signature, prefill, logits.shape[-1], params, windows, generator)
            step = held.step
            clear_slots(step, torch.arange(slots, device=device))
            self._fill(step, table, queue, first, (prefill, logits, next_pos))
            stats.prefill_s = time.perf_counter() - start

            runner = step
            if config.enable_graph_capture and params.max_new_tokens > 1:
                verdict = engine.agreement.decide(use_graph, held.graph is None)
                if verdict.eager_reason is not None:
                    use_graph, stats.fallback_reason = False, verdict.eager_reason
                if verdict.recapture:
                    stats.recapture_reason.append(PEER_RECAPTURE)
                    held.graph = None
            if use_graph and params.max_new_tokens > 1:
                if held.graph is None:
                    t_capture = time.perf_counter()
                    stats.captured = self._capture(held)
                    stats.capture_s = time.perf_counter() - t_capture
                    if not stats.captured:
                        stats.fallback_reason = engine._graphs_off_reason
                if held.graph is not None:
                    stats.path = "continuous_graph"
                    runner = self._replayer(held.graph, stats)

            t_decode = time.perf_counter()
            interval = config.eos_check_interval
            narrow = runner is step and (align or trim)
            attended = 0
            while table.occupied():
                if narrow:
                    step.span = self._span(table, queue, total)
                attended += step.span[1] - step.span[0] if narrow else total
                runner()
                stats.steps += 1
                for slot in table.occupied():
                    table.column[slot] = min(table.column[slot] + 1, total - 2)
                if stats.steps % interval == 0:
                    self._service(step, table, queue, (out_seq, out_resp, out_logp), align, trim)
            engine.backend.synchronize()
            stats.decode_s = time.perf_counter() - t_decode
            step.span = None
        stats.slots_refilled = table.refilled
        self.moved_columns = table.moved_columns
        self.mean_span = attended / stats.steps if stats.steps else float(total)
        result = self._result(out_seq, out_resp, out_logp, width, params, stats, slots)
        stats.total_s = time.perf_counter() - start
        if stats.captured:
            stats.first_call_s = stats.total_s
        return result

    def drop(self) -> None:
        """Release the graph and every buffer of the held signature."""
        held, self._held = self._held, None
        if held is not None:
            held.graph = None
            held.cache.release()
            self.engine.backend.empty_cache()

    @property
    def cache(self) -> StaticKVCache | None:
        return None if self._held is None else self._held.cache

    @property
    def step(self) -> ContinuousStep | None:
        return None if self._held is None else self._held.step

    # ---- pieces ---------------------------------------------------------------------------
    def _resources(
        self,
        signature: ContinuousSignature,
        prefill: object,
        vocab: int,
        params: SamplingParams,
        windows: dict[str, int | None],
        generator: torch.Generator | None,
    ) -> _Held:
        specs = StaticKVCache.specs_of(prefill)
        if self._held is not None:
            if self._held.cache.layer_specs() == specs:
                return self._held
            self.drop()
        model, device = self.engine.model, self.engine.backend.device
        slots, total = signature.graph.batch_size, signature.graph.total_len
        cache = StaticKVCache(specs, slots, total)
        masks = MaskBuffers.for_model(
            model.config,
            slots,
            total,
            model_dtype(model),
            device,
            windows,
            signature.graph.mask_form,
        )
        state = allocate_state(
            slots, total, vocab, params.eos_ids, int(params.pad_token_id), device
        )
        step = ContinuousStep(
            model, cache, masks, state, signature.graph.sampler, params.return_logprobs, generator
        )
        self._held = _Held(signature, cache, masks, step, generator)
        return self._held

    def _fill(
        self,
        step: ContinuousStep,
        table: SlotTable,
        queue: _Queue,
        requests: list[int],
        prefilled: tuple | None = None,
        front: int | None = None,
    ) -> None:
        """Prefill ``requests`` (one batch) and put them into free slots, first token chosen."""
        if not requests:
            return
        if prefilled is None:
            prefilled = self.engine._prefill(queue.ids[requests], queue.mask[requests])
        prefill, logits, next_pos = prefilled
        free = table.free()[: len(requests)]
        device = step.state.finished.device
        rows = torch.tensor(free, dtype=torch.long, device=device)
        width = queue.ids.shape[1]
        s = step.state
        step.cache.load_prefill(prefill, rows=rows)
        step.masks.reset(queue.mask[requests], rows=rows)
        s.sequences[rows, :width] = queue.ids[requests]
        s.positions[rows] = next_pos.view(-1, 1)
        s.finished[rows] = False
        s.generated[rows] = 0
        step.limits[rows] = torch.tensor(
            [queue.limits[r] for r in requests], dtype=torch.long, device=device
        )
        for slot, request in zip(free, requests, strict=True):
            table.request[slot] = request
            table.start[slot] = 0
            table.column[slot] = width
            if front is not None:
                _shift(step, table, slot, front - width)
        step.commit_rows(logits, rows)

    def _service(
        self,
        step: ContinuousStep,
        table: SlotTable,
        queue: _Queue,
        outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        align: bool,
        trim: bool,
    ) -> None:
        """The refill check: retire finished slots, then refill them from the queue."""
        # the one device read of the check; agreed over a process group (a row retires once it
        # is finished on every rank, so on the same step everywhere)
        finished = self.engine.agreement.finished_rows(step.state.finished)
        done = [i for i in table.occupied() if finished[i]]
        if done:
            self._retire(step, table, done, outputs, queue)
        requests = queue.take(len(table.free()))
        front = None
        if align:
            front = self._align(step, table, queue, trim, bool(requests))
        elif trim:
            self._trim(step, table, queue)
        table.refilled += len(requests)
        self._fill(step, table, queue, requests, front=front)

    @staticmethod
    def _retire(
        step: ContinuousStep,
        table: SlotTable,
        done: list[int],
        outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        queue: _Queue,
    ) -> None:
        out_seq, out_resp, out_logp = outputs
        width, max_new = queue.ids.shape[1], out_resp.shape[1]
        s = step.state
        for slot in done:
            request = table.request[slot]
            first = table.start[slot] + width  # the first response column (start may be < 0
            # once trimming dropped left padding; the prompt comes from the queue)
            out_seq[request, :width] = queue.ids[request]
            out_seq[request, width:] = s.sequences[slot, first : first + max_new]
            out_resp[request] = s.response[slot, first : first + max_new]
            out_logp[request] = s.logprobs[slot, first : first + max_new]
            table.request[slot] = -1
            table.start[slot] = 0
        clear_slots(step, torch.tensor(done, dtype=torch.long, device=out_seq.device))

    @staticmethod
    def _span(table: SlotTable, queue: _Queue, total: int) -> tuple[int, int]:
        """Columns any busy slot may attend to: from the first real prompt token to the
        furthest write column (host bookkeeping, no device read)."""
        busy = table.occupied()
        lo = min(table.start[i] + queue.pads[table.request[i]] for i in busy)
        hi = max(table.column[i] for i in busy) + 1
        return max(lo, 0), min(hi, total - 1)

    @staticmethod
    def _trim(step: ContinuousStep, table: SlotTable, queue: _Queue) -> None:
        """Drop the leading columns no active slot attends to (shift every active slot left):
        columns left of every row's first real prompt token (left padding, dead space)."""
        busy = table.occupied()
        if not busy:
            return
        lead = min(table.start[i] + queue.pads[table.request[i]] for i in busy)
        for slot in busy:
            _shift(step, table, slot, -lead)

    def _align(
        self, step: ContinuousStep, table: SlotTable, queue: _Queue, trim: bool, refilling: bool
    ) -> int:
        """Right-align every active slot at one write column; return it for the newcomers.

        Rows only move right here, so without trimming the front never moves back; it compacts
        (drops dead leading columns) only when a row could otherwise run into the sink.
        """
        if trim:
            self._trim(step, table, queue)
        busy = table.occupied()
        width = queue.ids.shape[1]
        sink = step.cache.max_len - 1  # host int: no device read
        max_new = (sink - width) // 2  # the buffers were sized W + 2 * max_new + 1
        front = max([table.column[i] for i in busy] + ([width] if refilling else []), default=width)
        if front + max_new >= sink:
            self._trim(step, table, queue)
            front = max([table.column[i] for i in busy] + [width])
        for slot in busy:
            _shift(step, table, slot, front - table.column[slot])
        return front

    def _capture(self, held: _Held) -> bool:
        """Capture the continuous step, leaving every buffer as it was; False on failure.

        K/V need no snapshot: warm-up writes each slot's current column, which the first replay
        rewrites with the same values (idle slots write only their sink column).
        """
        held.graph = self.engine._capture_agreed(held.step, held.generator)
        return held.graph is not None

    def _replayer(self, graph: object, stats: RolloutStats) -> Callable[[], None]:
        backend = self.engine.backend

        def replay() -> None:
            backend.replay_graph(graph)
            stats.replays += 1

        return replay

    def _result(
        self,
        out_seq: torch.Tensor,
        out_resp: torch.Tensor,
        out_logp: torch.Tensor,
        width: int,
        params: SamplingParams,
        stats: RolloutStats,
        slots: int,
    ) -> RolloutResult:
        lengths = out_resp.sum(-1)
        eos = torch.zeros(out_seq.shape[0], dtype=torch.bool, device=out_seq.device)
        last = (lengths - 1).clamp(min=0)
        last_token = out_seq[:, width:].gather(1, last[:, None]).squeeze(1)
        for token in params.eos_ids:
            eos |= last_token == token
        useful = int((lengths - 1).clamp(min=0).sum())
        stats.occupancy = useful / (slots * stats.steps) if stats.steps else 1.0
        stats.captures = self.engine.captures
        return RolloutResult(
            sequences=out_seq,
            response_mask=out_resp.to(torch.long),
            response_lengths=lengths,
            finish_reasons=["eos" if e else "length" for e in eos.tolist()],
            logprobs=out_logp if params.return_logprobs else None,
            stats=stats,
        )


def _limits(
    per_request: Sequence[int] | None, prompts: int, repeats: int, params: SamplingParams
) -> list[int]:
    """Each request's own max_new_tokens (default: the sampling settings' for every one)."""
    if per_request is None:
        return [params.max_new_tokens] * (prompts * repeats)
    values = [int(v) for v in per_request]
    if len(values) != prompts:
        raise ValueError(
            f"request_max_new_tokens has {len(values)} entries for {prompts} prompts; give one "
            "per prompt row"
        )
    bad = [v for v in values if not 1 <= v <= params.max_new_tokens]
    if bad:
        raise ValueError(
            f"request_max_new_tokens values must be in [1, max_new_tokens="
            f"{params.max_new_tokens}] (max_new_tokens sizes the cache), got {bad[:5]}"
        )
    return [v for v in values for _ in range(repeats)]


def _shift(step: ContinuousStep, table: SlotTable, slot: int, by: int) -> None:
    shift_row(step, slot, by)
    table.start[slot] += by
    table.column[slot] += by
    table.moved_columns += abs(by)
