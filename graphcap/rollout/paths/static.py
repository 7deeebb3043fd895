"""The static path: every row decodes in lock-step over one set of buffers (docs/rollout.md,
"Paths"). Plan, prefill, buffers from the holder, runner, decode, collect."""

from __future__ import annotations

import time

import torch

from graphcap.rollout.holder import GraphHolder
from graphcap.rollout.paths.ladder import Ladder
from graphcap.rollout.paths.record import begin
from graphcap.rollout.paths.runners import Runner, grow_blocks, start_runner
from graphcap.rollout.plan.inputs import Call
from graphcap.rollout.prefill import run_prefill
from graphcap.rollout.results import RolloutResult, RolloutStats, finish_details
from graphcap.rollout.sampling import RowPlan
from graphcap.rollout.settings.call import CallSettings
from graphcap.rollout.settings.rollout_config import RolloutConfig, bucket_size
from graphcap.rollout.step import DecodeState, DecodeStep


class StaticRollout:
    """Runs calls on the static, per-position or eager path of one engine."""

    def __init__(self, model: torch.nn.Module, config: RolloutConfig, holder: GraphHolder):
        self.model, self.config, self.holder = model, config, holder

    def run(self, call: Call, start: float) -> RolloutResult:
        input_ids, attention_mask, settings = call.input_ids, call.attention_mask, call.settings
        generator = call.generator
        if call.request_max_new_tokens is not None:
            raise ValueError(
                "request_max_new_tokens needs the continuous path: set "
                "RolloutConfig(continuous_batch_size=N)"
            )
        rows, width = input_ids.shape
        repeats = settings.num_return_sequences
        batch, total = rows * repeats, width + settings.max_new_tokens
        padded_batch = bucket_size(batch, self.config.batch_buckets)
        padded_total = self.config.total_length(self.model, total, self.holder.backend)
        plan, record = begin(self.model, self.config, self.holder, call, padded_batch, padded_total)

        prefill = run_prefill(self.model, input_ids, attention_mask)
        # prefill row of each batch row: samples of a prompt, then bucket padding rows
        sources = torch.arange(rows, device=input_ids.device).repeat_interleave(repeats)
        sources = torch.cat([sources, sources[-1:].expand(padded_batch - batch)])
        logits = prefill.logits.index_select(0, sources)
        step = self.holder.step_for(
            plan.signature,
            prefill.specs,
            lambda memory: DecodeStep.build(
                self.model, prefill.specs, plan, logits.shape[-1], settings, generator, memory
            ),
        )
        interval = self.config.eos_check_interval
        step.cache.reset()
        # every row writes column width + i at decode step i (host arithmetic, no device read)
        grow_blocks(self.holder, step, [width] * padded_batch, interval, record)
        step.cache.load_prefill(prefill.cache, source_rows=sources)
        step.masks.reset(attention_mask.index_select(0, sources))
        step.state.reset(
            input_ids.index_select(0, sources),
            prefill.next_positions.index_select(0, sources),
            RowPlan.build(call.per_prompt, repeats, padded_batch),
        )
        step.commit(logits)
        prefill_s = time.perf_counter() - start

        steps = settings.max_new_tokens - 1
        ladder = Ladder.for_call(self.config, plan, step, record, self.holder.agreement)
        runner = start_runner(
            self.holder,
            step,
            plan,
            record,
            graphs=self.config.wants_graphs(self.holder.backend),
            decode_steps=steps,
            ladder=ladder,
            columns=lambda i: [width + i] * padded_batch,
            ahead=interval,
        )
        t_decode, captured_s = time.perf_counter(), record.capture_s
        decoded = decode(runner, steps, step.state, interval, ladder)
        ladder.restore()
        self.holder.backend.synchronize()
        # captures taken inside the loop (the ladder's sizes, per-position graphs) count once,
        # in capture_s
        decode_s = time.perf_counter() - t_decode - (record.capture_s - captured_s)
        stats = record.stats(step, padded_batch, padded_total, decoded, prefill_s, decode_s)
        return collect(step.state, batch, width, total, settings, stats)


def decode(
    runner: Runner, max_steps: int, state: DecodeState, interval: int, ladder: Ladder
) -> int:
    """Run up to ``max_steps`` steps; stop early when the device says all rows finished, read
    as the ``ladder`` says (:meth:`Ladder.check_every`, :meth:`Ladder.check_and_shrink`: every
    ``interval`` steps, agreed over the process group; on the ladder more often, each read
    letting the live rows move to a smaller size). With ``interval`` 1 the flag is also read
    before the first step, so the call stops where ``generate`` stops (and draws as many random
    numbers) even when the prefill's token ended every row."""
    every = ladder.check_every(interval)
    if interval == 1 and max_steps and ladder.agreement.all_finished(state.all_finished):
        return 0
    for step in range(1, max_steps + 1):
        runner()
        if step % every or step == max_steps:
            continue
        if ladder.check_and_shrink():
            return step
    return max_steps


def collect(
    state: DecodeState,
    batch: int,
    width: int,
    total: int,
    settings: CallSettings,
    stats: RolloutStats,
) -> RolloutResult:
    """The caller's rows and columns (bucket padding cut off), copied out of the buffers."""
    response = state.response[:batch, width:total].to(torch.long)
    sequences = state.sequences[:batch, :total].clone()
    finished = state.finished[:batch].tolist()
    hits = state.stop_hit[:batch].tolist() if state.stop_hit is not None else None
    reasons, stops, matched = finish_details(
        sequences, response, finished, settings.eos_ids, hits, settings.stop_sequences
    )
    logprobs = state.logprobs[:batch, width:total].clone() if settings.return_logprobs else None
    k = settings.top_logprobs
    top = (state.top_values, state.top_ids) if k else (None, None)
    top = tuple(None if t is None else t[:batch, width:total, :k].clone() for t in top)
    decoded = stats.steps + 1  # the prefill's token and one a step
    scores = state.scores[:batch, :decoded].clone() if settings.output_scores else None
    logits = state.logits[:batch, :decoded].clone() if settings.output_logits else None
    return RolloutResult(
        sequences=sequences,
        response_mask=response,
        response_lengths=response.sum(-1),
        finish_reasons=reasons,
        logprobs=logprobs,
        stats=stats,
        stop_token_ids=stops,
        scores=scores,
        logits=logits,
        stop_sequences=matched,
        top_logprobs=top[0],
        top_logprob_ids=top[1],
    )
