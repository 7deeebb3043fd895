"""Token selection with transformers' generate() math, written to run inside a graph.

Every function takes and returns device tensors and reads no device value on the host, so the
same code serves the eager loop and the captured step. The order and the arithmetic follow
``generate`` (repetition penalty, min_new_tokens, temperature, top-k, top-p, then
``multinomial(softmax(scores.float()), 1)`` or argmax), which is what makes graph samples equal
to generate's for a fixed seed. One deliberate difference: the repetition penalty looks only at
written positions (prompt tokens and generated ones), never at left-pad slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcap.rollout.config import SamplingParams


@dataclass(frozen=True)
class SamplerSettings:
    """The host constants the sampler reads; all of them are part of the graph signature."""

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    min_new_tokens: int

    @classmethod
    def from_params(cls, params: SamplingParams) -> SamplerSettings:
        """Greedy ignores the warpers, so they are normalised away: changing them between two
        greedy calls must not change the graph signature (and force a recapture)."""
        sample = params.do_sample
        return cls(
            do_sample=sample,
            temperature=params.temperature if sample else 1.0,
            top_k=params.effective_top_k,
            top_p=params.top_p if sample else 1.0,
            repetition_penalty=params.repetition_penalty,
            min_new_tokens=params.min_new_tokens,
        )


def repetition_penalty(
    scores: torch.Tensor, tokens: torch.Tensor, written: torch.Tensor, penalty: float
) -> torch.Tensor:
    """Penalise every token id present at a written position of ``tokens`` (B, L).

    Same per-element math as transformers (``score < 0 ? score * p : score / p``, once per
    distinct token); presence is counted with ``scatter_add`` so unwritten or pad slots, which
    hold arbitrary ids, cannot collide with written ones.
    """
    counts = torch.zeros_like(scores).scatter_add_(1, tokens, written.to(scores.dtype))
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(counts > 0, penalised, scores)


def block_eos(
    scores: torch.Tensor, eos_vocab: torch.Tensor, generated: torch.Tensor, min_new_tokens: int
) -> torch.Tensor:
    """Forbid EOS ids while fewer than ``min_new_tokens`` tokens were generated (device count)."""
    blocked = eos_vocab[None, :] & (generated < min_new_tokens)
    return scores.masked_fill(blocked, -float("inf"))


def top_k_filter(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    k = min(top_k, scores.shape[-1])
    threshold = torch.topk(scores, k)[0][..., -1, None]
    return scores.masked_fill(scores < threshold, -float("inf"))


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_scores, sorted_ids = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(1, sorted_ids, remove_sorted)
    return scores.masked_fill(remove, -float("inf"))


def sanitise(scores: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
    """Make every row a distribution ``multinomial`` accepts.

    A row with ``+inf`` scores (a tiny temperature or repetition penalty overflowing float32, or
    an fp16 model's logits overflowing) draws uniformly among its ``+inf`` tokens, the limit of
    its distribution; finished rows, and rows with NaN or nothing finite, get flat logits. A
    NaN, ``+inf`` or all-zero distribution reaching ``multinomial`` is a device-side assert on
    some devices. The replacement changes no other row's draw: ``multinomial(p, 1)`` consumes
    the same random numbers whatever the values.
    """
    bad = finished | torch.isnan(scores).any(dim=-1) | torch.isneginf(scores).all(dim=-1)
    top = torch.isposinf(scores)
    scores = scores.masked_fill(top.any(dim=-1, keepdim=True) & ~top, -float("inf"))
    return scores.masked_fill(top, 0.0).masked_fill(bad[:, None], 0.0)


def process_scores(
    logits: torch.Tensor,
    settings: SamplerSettings,
    tokens: torch.Tensor,
    written: torch.Tensor,
    eos_vocab: torch.Tensor,
    generated: torch.Tensor,
) -> torch.Tensor:
    """generate()'s logits processors, in generate's order, on float32 scores."""
    scores = logits.float()  # every step below is out of place: no copy needed
    if settings.repetition_penalty != 1.0:
        scores = repetition_penalty(scores, tokens, written, settings.repetition_penalty)
    if settings.min_new_tokens > 0:
        scores = block_eos(scores, eos_vocab, generated, settings.min_new_tokens)
    if settings.do_sample:
        if settings.temperature != 1.0:
            scores = scores / settings.temperature
        if settings.top_k:
            scores = top_k_filter(scores, settings.top_k)
        if settings.top_p < 1.0:
            scores = top_p_filter(scores, settings.top_p)
    return scores


def choose(
    scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None
) -> torch.Tensor:
    """Argmax, or one multinomial draw per row over all rows (as generate draws)."""
    if do_sample:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    return torch.argmax(scores, dim=-1)
