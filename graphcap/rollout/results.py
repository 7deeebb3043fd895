"""What a rollout returns: the rows generated and the statistics of the call."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RolloutStats:
    """What one ``generate`` call did.

    ``captures`` counts the graphs this engine has captured so far (all calls); ``replays`` and
    ``steps`` count this call's graph replays and decode steps (the prefill token excluded).
    ``first_call_s`` is the whole call's time when this call captured, else ``None``.
    ``batch_size`` / ``total_len`` are the sizes the buffers had (after bucket padding).
    ``slots_refilled`` / ``occupancy`` (share of slot-steps that produced a token) are set by the
    continuous path only, and so are ``moved_columns`` (cache columns the eager layout modes
    moved) and ``mean_span`` (cache columns a step attended over, on average) (docs/continuous.md).
    ``capture_s``: seconds spent capturing, of which ``warmup_s`` is the step's run before
    the capture (where a compiled step compiles and each kernel is first used).
    ``attention``: the attention implementation the decode steps ran. ``compiled``: they ran
    the blocks around attention compiled (``RolloutConfig.compile``); ``compile_cache``: what
    the capture that compiled did with the compile cache (``"loaded"``, ``"new"``,
    ``"unreadable"``, ``"off"``; :mod:`graphcap.rollout.holder.compile_cache`), ``None`` when this
    call compiled nothing. ``joined_projections``: groups of
    projections that ran as one product (``RolloutConfig(fuse_projections=True)``).
    """

    path: str
    batch_size: int = 0
    total_len: int = 0
    captures: int = 0
    captured: bool = False
    replays: int = 0
    steps: int = 0
    prefill_s: float = 0.0
    capture_s: float = 0.0
    warmup_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    first_call_s: float | None = None
    fallback_reason: str | None = None
    recapture_reason: list[str] = field(default_factory=list)
    slots_refilled: int = 0
    occupancy: float | None = None
    moved_columns: int = 0
    mean_span: float | None = None
    attention: str | None = None
    compiled: bool = False
    compile_cache: str | None = None
    joined_projections: int = 0


@dataclass
class RolloutResult:
    """Prompt + response per row, in generate()'s row order (samples of a prompt adjacent).

    ``finish_reasons``: "eos" (an EOS id ended the row), "stop" (one of ``stop_token_ids``) or
    "length". ``stop_token_ids``: the id that ended each row, ``None`` for "length" rows (vLLM's
    ``stop_reason``, EOS included). ``scores`` / ``logits`` (``SamplingParams.output_scores`` /
    ``output_logits``): float32 ``(rows, steps + 1, vocab)``, one entry per token position the
    call decoded (the prefill's first), as ``generate`` returns them per step.
    """

    sequences: torch.Tensor
    response_mask: torch.Tensor
    response_lengths: torch.Tensor
    finish_reasons: list[str]
    logprobs: torch.Tensor | None
    stats: RolloutStats
    stop_token_ids: list[int | None] | None = None
    scores: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def finish_details(
    sequences: torch.Tensor,
    response_mask: torch.Tensor,
    finished: list[bool],
    eos_ids: tuple[int, ...],
) -> tuple[list[str], list[int | None]]:
    """``finish_reasons`` and ``stop_token_ids`` of rows of prompt + response ``sequences``
    (B, W + N) with ``response_mask`` (B, N): a finished row's last response token stopped it."""
    width = sequences.shape[1] - response_mask.shape[1]
    last = (width + response_mask.sum(-1) - 1).clamp(min=width)
    tokens = sequences.gather(1, last[:, None]).squeeze(1).tolist()
    stops = [token if done else None for token, done in zip(tokens, finished, strict=True)]
    reasons = ["length" if t is None else "eos" if t in eos_ids else "stop" for t in stops]
    return reasons, stops
