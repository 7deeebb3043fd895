"""The eager prefill every path starts from: one forward over the prompts, last logits only."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from graphcap.rollout.cache import LayerSpec, StaticKVCache


@dataclass
class Prefill:
    """What the prefill produced for ``R`` prompt rows."""

    cache: DynamicCache
    logits: torch.Tensor  # (R, V): the last position's logits
    next_positions: torch.Tensor  # (R,): the position id of each row's first new token

    @property
    def specs(self) -> tuple[LayerSpec, ...]:
        return StaticKVCache.specs_of(self.cache)


def run_prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> Prefill:
    """Forward the left-padded prompts (positions counted over real tokens, as generate)."""
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    cache = DynamicCache()
    extra = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **{cache_keyword(model): cache},
        **extra,
    )
    return Prefill(cache, out.logits[:, -1, :], position_ids[:, -1] + 1)


@contextlib.contextmanager
def without_checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """Turn gradient checkpointing off for a rollout, then back on.

    With checkpointing on and the model in ``train()`` (as right after a training step),
    transformers forces ``use_cache=False`` and returns no cache; under ``no_grad`` checkpointing
    saves nothing anyway.
    """
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for module in flagged:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in flagged:
            module.gradient_checkpointing = True


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: ``cache`` from transformers 5.24 on
    (``past_key_values`` is deprecated there and goes in 5.40), ``past_key_values`` before."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
