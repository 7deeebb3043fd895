"""The rl-round workload: a GRPO-shaped rollout round (prompts of ragged widths, several samples
each, sampled rows ending at EOS ids), and what a round's own lengths say it costs at least."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from graphcap.backend import Backend
from graphcap.bench import models
from graphcap.bench.config import BenchConfig
from graphcap.bench.modes import CallOutput, Workload
from graphcap.bench.report import ModeResult


def round_workload(
    cfg: BenchConfig, model: Any, backend: Backend, peaks: tuple, settings: dict
) -> Workload:
    """The round every mode runs: ``cfg``'s prompts, samples and EOS ids, the engine's
    ``settings``; its limit from ``peaks`` (bytes/s, FLOP/s) where both are known."""
    vocab = model.config.vocab_size
    ids, mask = round_prompts(vocab, cfg.prompts, cfg.prompt_widths, cfg.seed, backend.device)
    eos = eos_ids(vocab, cfg.new_tokens, cfg.eos_fraction, cfg.seed)
    sampling = {"do_sample": True, "temperature": cfg.temperature, "top_k": cfg.top_k}
    sampling.update(top_p=cfg.top_p, eos_token_id=eos, num_return_sequences=cfg.samples)
    weights, parameters = models.weight_bytes_per_step(model), models.step_parameters(model)
    limit = functools.partial(
        round_limit,
        weight_bytes=weights,
        parameters=sum(p.numel() for p in parameters),
        kv_bytes_per_token=models.kv_bytes_per_token(model),
        bandwidth=peaks[0],
        flops=peaks[1],
    )
    args = (model, backend, ids, mask, cfg.new_tokens, cfg.continuous_slots, settings, sampling)
    return Workload(*args, cfg.seed, limit if all(peaks) else None)


def round_prompts(
    vocab: int, prompts: int, widths: Sequence[int], seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of widths drawn from ``widths`` (least, most), left-padded with id 0."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(widths[0], widths[-1] + 1, (prompts, 1), generator=generator)
    width = int(lengths.max())
    mask = (torch.arange(width) >= width - lengths).long()
    ids = torch.randint(1, vocab, (prompts, width), generator=generator) * mask
    return ids.to(device), mask.to(device)


def eos_ids(vocab: int, new_tokens: int, mean_fraction: float, seed: int) -> list[int]:
    """EOS ids (never the pad id 0) so many that a near-flat distribution ends a row at each step
    with probability ~ |E| / vocab: a mean length of ``mean_fraction`` x ``new_tokens`` before
    the cap cuts the longest rows."""
    count = min(vocab - 1, max(1, round(vocab / (mean_fraction * new_tokens))))
    generator = torch.Generator().manual_seed(seed + 1)
    return sorted((torch.randperm(vocab - 1, generator=generator)[:count] + 1).tolist())


def response_lengths(tokens: torch.Tensor, eos: Sequence[int], cap: int) -> list[int]:
    """Each row's useful tokens: up to and including its first EOS, else the cap."""
    ended = torch.isin(tokens, torch.tensor(list(eos), dtype=tokens.dtype))
    first = torch.where(ended.any(1), ended.int().argmax(1) + 1, cap)
    return first.tolist()


def round_limit(
    lengths: Sequence[int],
    prompt_tokens: Sequence[int],
    *,
    weight_bytes: int,
    parameters: int,
    kv_bytes_per_token: int,
    bandwidth: float,
    flops: float,
) -> float:
    """Seconds a round of these lengths takes at least: the prefill's products, then per decode
    step the weights read or the live rows' products (whichever is slower), plus the live rows'
    K/V read. The first token of a row comes from the prefill, so step ``s`` serves rows longer
    than ``s``."""
    seconds = 2 * parameters * sum(prompt_tokens) / flops
    for s in range(1, max(lengths)):
        live = [w + s for n, w in zip(lengths, prompt_tokens, strict=True) if n > s]
        products = max(weight_bytes / bandwidth, 2 * parameters * len(live) / flops)
        seconds += products + kv_bytes_per_token * sum(live) / bandwidth
    return seconds


def dead_share(lengths: Sequence[int]) -> float:
    """Share of row-steps (rows x steps until the longest row ended) spent on ended rows."""
    return 1 - sum(lengths) / (len(lengths) * max(lengths))


def fill_round(
    r: ModeResult,
    work: Workload,
    first: CallOutput,
    calls: list[CallOutput],
) -> None:
    """The round figures of ``first`` and the steady ``calls`` (medians over the steady ones)."""
    cap, eos, limit = work.new_tokens, work.sampling["eos_token_id"], work.limit
    prompt = work.attention_mask.sum(1).repeat_interleave(work.sampling["num_return_sequences"])
    r.round_lengths = [response_lengths(c.tokens, eos, cap) for c in (first, *calls)]
    limits: list[Any] = [limit(n, prompt.tolist()) if limit else None for n in r.round_lengths]
    r.round_limit_s = limits
    steady = list(zip(r.round_lengths[1:], limits[1:], r.steady_s, strict=True))
    r.useful_tokens = round(statistics.median(sum(n) for n, _, _ in steady))
    r.tokens_per_s = statistics.median(sum(n) / s for n, _, s in steady)
    r.dead_share = statistics.median(dead_share(n) for n, _, _ in steady)
    r.limit_fraction = statistics.median(lim / s for _, lim, s in steady) if limit else None
