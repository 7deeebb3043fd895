"""What a call's runners did with graphs, kept while it decodes; the call's RolloutStats are
built from it once, at the end of the path.

Every capture of a call (the full step's, a per-position graph's, a ladder size's, a recapture
after the block pools grew) goes through :meth:`Record.capture`: one place turns a
:class:`~graphcap.rollout.holder.capture.CaptureOutcome` into the path taken, the capture
seconds and the reason a call fell back to eager steps.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields

import torch

from graphcap.errors import NonFiniteLogitsWarning
from graphcap.rollout.holder import FULL_STEP, GraphHolder, GraphKey
from graphcap.rollout.holder.agreement import PEER_RECAPTURE
from graphcap.rollout.plan import DecodePath, Plan, plan_call
from graphcap.rollout.plan.inputs import Call, check_request
from graphcap.rollout.results import RolloutStats
from graphcap.rollout.settings.rollout_config import RolloutConfig
from graphcap.rollout.step import DecodeStep


@dataclass
class Record:
    """The path a call's steps took and what its runners counted (``RolloutStats``' names)."""

    path: DecodePath
    fallback_reason: str | None
    recapture_reason: list[str]
    sampler_shape: str = "greedy"
    capture_reasons: list[str] = field(default_factory=list)
    attention: str | None = None
    compiled: bool = False
    captured: bool = False
    capture_s: float = 0.0
    warmup_s: float = 0.0
    compile_cache: str | None = None
    replays: int = 0
    batch_steps: dict[int, int] = field(default_factory=dict)
    row_steps: int = 0
    rows_moved: int = 0

    @classmethod
    def start(cls, holder: GraphHolder, plan: Plan) -> Record:
        """A call's record before it decodes: eager (graphs come with a runner), the plan's
        reason, and what the holder dropped for the plan's signature."""
        dropped = holder.release_stale(plan.signature)
        return cls(plan.path.eager_fallback, plan.reason, dropped, plan.sampler.describe())

    def agree(self, holder: GraphHolder, plan: Plan, missing: bool) -> bool:
        """Whether the call uses graphs, as the process group agreed (``missing``: this rank
        must capture)."""
        verdict = holder.agree(plan.graph, missing)
        if verdict.eager_reason is not None:
            self.fallback_reason = verdict.eager_reason
            return False
        if verdict.recapture:
            self.recapture_reason.append(PEER_RECAPTURE)
        return plan.graph

    def replaying(self, plan: Plan) -> None:
        """The call's steps run on the plan's graph path."""
        self.path, self.attention, self.compiled = plan.path, plan.attention, plan.compiled

    def capture(
        self, holder: GraphHolder, step: DecodeStep, plan: Plan, key: GraphKey = FULL_STEP
    ) -> object | None:
        """Capture ``step`` as the holder's graph ``key``; ``None`` when it failed, after which
        the call's remaining steps run eagerly (its path the eager one, with the reason). The
        record keeps why the graph was missing."""
        self.capture_reasons.append(holder.capture_reason(key))
        outcome = holder.capture(step, plan.attention, key=key, compiled=plan.compiled)
        self.capture_s += outcome.capture_s
        self.warmup_s += outcome.warmup_s
        self.compile_cache = outcome.compile_cache or self.compile_cache
        if outcome.graph is None:
            self.path, self.fallback_reason = self.path.eager_fallback, outcome.reason
        else:
            self.captured = True
        return outcome.graph

    def stats(
        self,
        step: DecodeStep,
        batch_size: int,
        total_len: int,
        steps: int,
        prefill_s: float,
        decode_s: float,
        **path: object,
    ) -> RolloutStats:
        """The call's RolloutStats: this record, the call's sizes, steps and phases, what its
        ``step`` holds (NaN draws, K/V figures) and the figures of its ``path`` alone."""
        recorded = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutStats(
            **recorded | {"path": self.path.value},
            batch_size=batch_size,
            total_len=total_len,
            steps=steps,
            prefill_s=prefill_s,
            decode_s=decode_s,
            nan_draws=nan_draws(step),
            **kv_figures(step),
            **path,
        )


def nan_draws(step: DecodeStep) -> int:
    """The tokens the call sampled from NaN logits, warned about: the sampler hides a NaN (it
    must not reach ``multinomial``), and it is the one sign of a diverged policy."""
    draws = int(step.state.nan_draws)
    if draws:
        warnings.warn(
            f"{draws} sampled token(s) of this call were drawn for rows whose logits "
            "held NaN (the model's weights or activations have diverged?): they are uniform "
            "draws, not the model's; stats.nan_draws counts them",
            NonFiniteLogitsWarning,
            stacklevel=5,  # the caller of generate (through stats, run and generate)
        )
    return draws


def kv_figures(step: DecodeStep) -> dict[str, object]:
    """The call's K/V figures, by their ``RolloutStats`` names: layout, peak blocks held, pool
    growths, cache bytes."""
    return step.cache.figures()


def begin(
    model: torch.nn.Module,
    config: RolloutConfig,
    holder: GraphHolder,
    call: Call,
    batch: int,
    total: int,
) -> tuple[Plan, Record]:
    """What both paths do first: refuse a call that cannot run (``batch`` rows of ``total``
    columns), plan it, and start its record (releasing what the holder held for another
    signature)."""
    shape, held = call.input_ids.shape, holder.held_bytes()
    check_request(
        model, call.scan, holder.backend, config, call.settings, shape, batch, total, held
    )
    plan = plan_call(
        model,
        holder.backend,
        config,
        call.settings,
        call.generator,
        batch_size=batch,
        total_len=total,
        prompt_width=shape[1],
        sampler=holder.sampler_for(call.per_prompt),
        disabled_reason=holder.disabled_reason,
        scan=call.scan,
    )
    return plan, Record.start(holder, plan)
