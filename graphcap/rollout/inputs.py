"""Checks of one generate() call's inputs, made before any device work.

Every refusal here names the argument and says what to do; what passes is normalised (ids as
long on the backend's device, the mask as 0/1 long, sampling settings resolved against the
model's generation config).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeAlias

import torch
from transformers import GenerationConfig

from graphcap.rollout.config import SamplingParams
from graphcap.rollout.sampling import per_prompt_params

if TYPE_CHECKING:
    from transformers import PreTrainedModel


Sampling: TypeAlias = "SamplingParams | GenerationConfig | Sequence[SamplingParams] | None"
#: Fields that shape the whole call: a per-row list must agree on them.
CALL_FIELDS: tuple[str, ...] = (
    "max_new_tokens",
    "num_return_sequences",
    "eos_token_id",
    "pad_token_id",
    "return_logprobs",
    "stop_token_ids",
)


@dataclass(frozen=True)
class Call:
    """One generate() call after its checks: what a path's ``run`` takes."""

    input_ids: torch.Tensor  # (R, W) long, on the backend's device
    attention_mask: torch.Tensor  # (R, W) 0/1 long
    params: SamplingParams  # the call's summary (whole-call fields; do_sample = any row)
    per_prompt: list[SamplingParams]  # one per prompt row
    generator: torch.Generator | None
    request_max_new_tokens: Sequence[int] | None  # continuous path only

    @property
    def draws(self) -> bool:
        """Whether any row samples from the shared generator (sampled, no seed of its own)."""
        return any(p.do_sample and p.seed is None for p in self.per_prompt)


def resolve_sampling(model: PreTrainedModel, sampling: Sampling) -> SamplingParams:
    """The call's settings, EOS and pad filled from the model's generation config.

    For a per-row list: the rows must agree on :data:`CALL_FIELDS`; the call's summary is the
    first row with ``do_sample`` = any row samples and ``min_new_tokens`` = the smallest.
    """
    if isinstance(sampling, (list, tuple)):
        rows = [_resolve_one(model, s) for s in sampling]
        if not rows:
            raise ValueError("sampling is an empty list; give one SamplingParams per prompt row")
        for name in CALL_FIELDS:
            differing = [
                i for i, r in enumerate(rows) if getattr(r, name) != getattr(rows[0], name)
            ]
            if differing:
                raise ValueError(
                    f"sampling rows {differing} differ from row 0 in {name}, which applies to the "
                    "whole call; give every row the same value"
                )
        return replace(
            rows[0],
            do_sample=any(r.do_sample for r in rows),
            min_new_tokens=min(r.min_new_tokens for r in rows),
        )
    return _resolve_one(model, sampling)


def row_settings(model: PreTrainedModel, sampling: Sampling, rows: int) -> list[SamplingParams]:
    """One resolved :class:`SamplingParams` per prompt row (see ``per_prompt_params``)."""
    if isinstance(sampling, (list, tuple)):
        return per_prompt_params([_resolve_one(model, s) for s in sampling], rows)
    return per_prompt_params(_resolve_one(model, sampling), rows)


def _resolve_one(
    model: PreTrainedModel, sampling: SamplingParams | GenerationConfig | None
) -> SamplingParams:
    if sampling is None:
        sampling = SamplingParams()
    elif isinstance(sampling, GenerationConfig):
        sampling = SamplingParams.from_generation_config(sampling)
    elif not isinstance(sampling, SamplingParams):
        raise TypeError(
            f"sampling must be SamplingParams, transformers.GenerationConfig or a list of "
            f"SamplingParams (one per prompt row), got {type(sampling).__name__}"
        )
    gen_config = getattr(model, "generation_config", None)
    eos = getattr(gen_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return sampling.resolved(eos, getattr(gen_config, "pad_token_id", None))


def check_prompts(
    model: torch.nn.Module,
    device: torch.device,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts as (long ids, 0/1 long mask) on ``device``."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a 2-D tensor (batch, prompt_width)")
    if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids "
            f"shape {tuple(input_ids.shape)}"
        )
    mask = attention_mask.to(torch.long)
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("attention_mask must contain only 0 and 1")
    if (mask.sum(-1) == 0).any():
        raise ValueError("a prompt row has no tokens (attention_mask all zero)")
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise ValueError(
            "attention_mask is right-padded (a 0 after a 1); the rollout engine needs left "
            "padding: set tokenizer.padding_side = 'left'"
        )
    model_device = next(model.parameters()).device
    if model_device != device:
        raise ValueError(
            f"model is on {model_device} but the backend runs on {device}; move the model "
            "there first"
        )
    return input_ids.to(device=device, dtype=torch.long), mask.to(device)


def check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    """The generator must draw on the device the sampler runs on."""
    if generator is not None and generator.device.type != device.type:
        raise ValueError(
            f"generator is on {generator.device} but the backend samples on "
            f"{device}; pass torch.Generator(device={str(device)!r})"
        )


def check_vocab_ids(model: PreTrainedModel, params: SamplingParams) -> None:
    """EOS and pad ids must index the vocabulary (they index device tables in the step)."""
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else model.config.vocab_size
    checks = (
        ("eos_token_id", params.eos_ids),
        ("pad_token_id", (params.pad_token_id,)),
        ("stop_token_ids", params.stop_token_ids or ()),
    )
    for name, ids in checks:
        for token in ids:
            if not 0 <= int(token) < vocab:
                raise ValueError(f"{name} {token} is outside the vocabulary [0, {vocab})")
