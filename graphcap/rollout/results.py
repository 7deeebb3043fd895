"""What a rollout returns: the rows generated and the statistics of the call."""

from __future__ import annotations

import warnings
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
    the capture (where a compiled step compiles and each kernel is first used); ``decode_s``:
    the decode loop's seconds without the captures taken inside it (the ladder's sizes,
    per-position graphs), which ``capture_s`` holds.
    ``attention``: the attention implementation the decode steps ran. ``compiled``: they ran
    the blocks around attention compiled (``RolloutConfig.compile``); ``compile_cache``: what
    the capture that compiled did with the compile cache (``"loaded"``, ``"new"``,
    ``"unreadable"``, ``"off"``; :mod:`graphcap.rollout.holder.compile_cache`), ``None`` when this
    call compiled nothing. ``fused_projections``: groups of
    projections that ran as one product (``RolloutConfig(fuse_projections=True)``;
    ``joined_projections`` is its deprecated name).
    ``batch_steps``: decode steps run at each batch size (the live-row ladder,
    ``RolloutConfig.batch_ladder``; empty when the call did not use it), ``row_steps``: rows
    those steps computed (their sum of sizes), ``rows_moved``: rows that changed places to let
    a smaller size run them.
    ``kv_layout``: ``"static"`` (one K/V buffer per row) or ``"blocks"`` (the block table,
    ``RolloutConfig.kv_block_size``); ``kv_blocks_held``: the most blocks rows held at once in
    the call; ``kv_pool_growths``: times the block pools grew (each drops the graph reading
    them), over the cache's life; ``kv_cache_bytes``: the K/V buffers' size at the call's end.
    ``nan_draws``: tokens sampled for rows whose logits held NaN (a diverged model; each such
    draw is uniform, and the call warns with a ``NonFiniteLogitsWarning``).
    ``wake_s``: seconds this call spent mapping the engine's memory again after a ``sleep``
    that kept its graphs (part of ``total_s``); ``None`` when the engine was awake.
    ``weights``: what the graphs read: ``"model"`` (the model's own tensors), ``"adopted"``
    (some of them moved and the engine holds the storage its graphs read) or ``"copy"`` (the
    engine's own copy, ``RolloutConfig.weights``); ``weights_copied``: tensors copied into
    them for this call (:mod:`graphcap.rollout.holder.weights`).
    ``sampler_shape``: what the call's sampler ran (:meth:`SamplerShape.describe
    <graphcap.rollout.sampling.SamplerShape.describe>`, e.g. ``"samples, truncates, keyed"``;
    the engine keeps a graph per shape and each call replays its own).
    ``capture_reasons``: why each graph this call captured was missing, in capture order (a
    new signature, a sampler shape first met, a ladder size first reached, a per-position
    graph).
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
    batch_steps: dict[int, int] = field(default_factory=dict)
    row_steps: int = 0
    rows_moved: int = 0
    fused_projections: int = 0
    kv_layout: str = "static"
    kv_blocks_held: int = 0
    kv_pool_growths: int = 0
    kv_cache_bytes: int = 0
    nan_draws: int = 0
    wake_s: float | None = None
    weights: str = "model"
    weights_copied: int = 0
    sampler_shape: str = "greedy"
    capture_reasons: list[str] = field(default_factory=list)

    @property
    def joined_projections(self) -> int:
        """Deprecated name of ``fused_projections``."""
        warnings.warn(
            "RolloutStats.joined_projections is deprecated; read fused_projections",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.fused_projections


@dataclass(frozen=True)
class SleepReport:
    """What one ``RolloutEngine.sleep()`` gave back.

    ``kept_graphs``: the memory was released in place (the graphs replay after the wake)
    rather than freed with the graphs. ``held_bytes``: what the engine held before (its memory
    region, or the K/V cache where it has none). ``free_before`` / ``free_after``: the
    backend's own free-memory report around the release (``Backend.free_memory``; ``None``
    where the device does not say), so ``given_back`` is what the device saw return.
    ``still_held_bytes``: memory the engine keeps through the sleep (storage of moved weights
    its graphs read, outside its region). ``seconds``: the release's time.
    """

    kept_graphs: bool
    held_bytes: int
    free_before: int | None
    free_after: int | None
    still_held_bytes: int
    seconds: float

    @property
    def given_back(self) -> int | None:
        """Bytes the device reported free after the release and not before."""
        if self.free_before is None or self.free_after is None:
            return None
        return self.free_after - self.free_before


@dataclass
class RolloutResult:
    """Prompt + response per row, in generate()'s row order (samples of a prompt adjacent).

    ``finish_reasons``: "eos" (an EOS id ended the row), "stop" (one of ``stop_token_ids`` or
    ``stop_sequences``) or "length". ``stop_token_ids``: the id that ended each row, ``None``
    for "length" rows and rows a stop sequence ended (vLLM's ``stop_reason``, EOS included);
    ``stop_sequences``: the stop sequence that ended each row, else ``None`` (only when the
    call had some). ``top_logprobs`` / ``top_logprob_ids`` (``SamplingParams.top_logprobs=k``,
    vLLM's ``logprobs=k``): ``(rows, max_new_tokens, k)``, the ``k`` most likely tokens at each
    response position, most likely first, under ``logprobs_mode``'s distribution (0 outside
    the response). ``scores`` / ``logits`` (``SamplingParams.output_scores`` /
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
    stop_sequences: list[tuple[int, ...] | None] | None = None
    top_logprobs: torch.Tensor | None = None
    top_logprob_ids: torch.Tensor | None = None

    @property
    def responses(self) -> torch.Tensor:
        """Response-only tokens ``(rows, max_new_tokens)``, pad after a row ended (verl's
        ``responses``)."""
        return self.sequences[:, self.sequences.shape[1] - self.response_mask.shape[1] :]

    @property
    def response_bool_mask(self) -> torch.Tensor:
        """``response_mask`` as bool: True at the tokens each row generated."""
        return self.response_mask.bool()


def finish_details(
    sequences: torch.Tensor,
    response_mask: torch.Tensor,
    finished: list[bool],
    eos_ids: tuple[int, ...],
    stop_hits: list[int] | None = None,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
) -> tuple[list[str], list[int | None], list[tuple[int, ...] | None] | None]:
    """``finish_reasons``, ``stop_token_ids`` and ``stop_sequences`` of rows of prompt +
    response ``sequences`` (B, W + N) with ``response_mask`` (B, N): a finished row's last
    response token stopped it, unless ``stop_hits`` (per row, -1 = none) names the stop
    sequence that did."""
    width = sequences.shape[1] - response_mask.shape[1]
    last = (width + response_mask.sum(-1) - 1).clamp(min=width)
    tokens = sequences.gather(1, last[:, None]).squeeze(1).tolist()
    hits = stop_hits if stop_hits is not None else [-1] * len(tokens)
    stops = [
        token if done and hit < 0 else None
        for token, done, hit in zip(tokens, finished, hits, strict=True)
    ]
    reasons = [
        "stop" if hit >= 0 else "length" if t is None else "eos" if t in eos_ids else "stop"
        for t, hit in zip(stops, hits, strict=True)
    ]
    matched = [stop_sequences[h] if h >= 0 else None for h in hits] if stop_sequences else None
    return reasons, stops, matched
