"""A benchmark's prompts (a round's too), the weight-bandwidth roofline and a round's physical
limit; the models are :mod:`graphcap.preset_models`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from graphcap.preset_models import SHAPE
from graphcap.rollout.plan.inputs import kv_bytes_per_token


def describe_model(model: PreTrainedModel) -> dict[str, Any]:
    """Architecture, shape, distinct parameter count (a tied weight counts once) and dtype."""
    dtype, parameters = next(model.parameters()).dtype, sum(p.numel() for p in model.parameters())
    described = {"architecture": type(model).__name__, "parameters": parameters}
    described["dtype"] = str(dtype).removeprefix("torch.")
    return described | {k: v for k in SHAPE if (v := getattr(model.config, k, None)) is not None}


def make_prompts(
    vocab: int, batch: int, length: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random full-length token prompts (no padding), the same for every mode."""
    generator = torch.Generator().manual_seed(seed + batch)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    return ids.to(device), torch.ones_like(ids).to(device)


def round_prompts(
    vocab: int, prompts: int, widths: Sequence[int], seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's random prompts, widths drawn from ``widths`` (least, most), left-padded (id 0)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(widths[0], widths[-1] + 1, (prompts, 1), generator=generator)
    mask = (torch.arange(width := int(lengths.max())) >= width - lengths).long()
    ids = torch.randint(1, vocab, (prompts, width), generator=generator) * mask
    return ids.to(device), mask.to(device)


def eos_ids(vocab: int, new_tokens: int, mean_fraction: float, seed: int) -> list[int]:
    """EOS ids (never the pad id 0), vocab / (``mean_fraction`` x ``new_tokens``) of them: a
    near-flat distribution ends a row at each step with probability ~ |E| / vocab."""
    count = min(vocab - 1, max(1, round(vocab / (mean_fraction * new_tokens))))
    ids = torch.randperm(vocab - 1, generator=torch.Generator().manual_seed(seed + 1))[:count]
    return sorted((ids + 1).tolist())


def round_limit(lengths: Sequence[int], prompts: Sequence[int], costs: Sequence[float]) -> float:
    """Least seconds of a round of these response ``lengths`` after ``prompts`` (tokens a row), at
    ``costs`` (:func:`round_costs`): the prefill's products, then per decode step the weights'
    read or the live rows' products (the slower) plus their K/V read. A row's first token comes
    from the prefill: step ``s`` serves the rows longer than ``s``."""
    weights, parameters, kv, bandwidth, flops = costs
    seconds = 2 * parameters * sum(prompts) / flops
    for s in range(1, max(lengths)):
        live = [w + s for n, w in zip(lengths, prompts, strict=True) if n > s]
        products = max(weights / bandwidth, 2 * parameters * len(live) / flops)
        seconds += products + kv * sum(live) / bandwidth
    return seconds


def round_costs(model: nn.Module, peaks: Sequence[float | None]) -> tuple | None:
    """Weight bytes a step reads, parameters, K/V bytes a token, and ``peaks`` (bytes/s, FLOP/s;
    None where either is unknown)."""
    parameters = sum(p.numel() for p in step_parameters(model))
    kv = kv_bytes_per_token(model, next(model.parameters()).element_size())
    costs = (weight_bytes_per_step(model), parameters, kv, *peaks)
    return costs if all(peaks) else None


#: Peak memory bandwidth (bytes/s, datasheets) and attainable dense bf16 products (FLOP/s, below
#: the datasheet's peak) by device-name fragment, first match wins: a small-batch decode step
#: reads every weight once, so bandwidth bounds its speed; a large batch's products bound it too.
PEAK_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))
PEAK_BANDWIDTH += (("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12))
PEAK_FLOPS = (("H200", 7.9e14), ("H100 80GB HBM3", 7.9e14))  # one GH100 chip, same clocks


def step_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The weights a decode step reads: all but embeddings that are not the output layer."""
    output = getattr(model.get_output_embeddings(), "weight", None)
    lookup = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - {id(output)}
    return [p for p in model.parameters() if id(p) not in lookup]


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights a decode step reads."""
    return sum(p.numel() * p.element_size() for p in step_parameters(model))


def peak_bandwidth(name: str, override: float | None = None, table: tuple = PEAK_BANDWIDTH) -> Any:
    """Peak rate for ``name`` (bytes/s, or FLOP/s from ``PEAK_FLOPS``): the override, else the
    table (accelerators only), else None."""
    if override is not None and override <= 0:
        raise ValueError(f"--peak-bandwidth and --peak-flops must be positive, got {override}")
    return override or next((bw for k, bw in table if k.lower() in name.lower()), None)


def parse_bandwidth(text: str) -> float:
    """Parse "4.8TB/s", "4800GB/s", "790TFLOP/s", "4.8e12" into bytes (FLOP) per second."""
    cleaned = text.strip().lower().removesuffix("/s").removesuffix("flop").removesuffix("b")
    scale = {"t": 1e12, "g": 1e9, "m": 1e6}.get(cleaned[-1:], 1.0)
    try:
        return float(cleaned[:-1] if scale != 1.0 else cleaned) * scale
    except ValueError:
        raise ValueError(f"cannot read bandwidth {text!r}; write e.g. 4.8TB/s or 4.8e12") from None
