"""The conformance checks' tiny models and prompts: :mod:`graphcap.tiny_models` at a vocabulary
of 96, on the device under test.

Two families, GPT-2 (learned positions) and Llama (rotary, grouped-query K/V): each forward costs
well under a millisecond on a CPU, so the engine-level checks stay cheap.
"""

from __future__ import annotations

import torch

from graphcap import tiny_models
from graphcap.tiny_models import EOS, PAD

VOCAB = 96
MODELS = ("gpt2", "llama")
__all__ = ["EOS", "MODELS", "PAD", "VOCAB", "build", "prompts"]


def build(name: str, device: torch.device, attn: str = "sdpa") -> torch.nn.Module:
    """The named tiny model with fixed weights, in eval mode on ``device``."""
    return tiny_models.tiny_model(name, attn, vocab_size=VOCAB).to(device)


def prompts(
    batch: int, device: torch.device, width: int = 5, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (row ``i`` has ``i % 2`` pads) of ids 3..VOCAB-1, and their mask."""
    return tiny_models.prompts(
        batch, width, vocab_size=VOCAB, seed=seed, pad_cycle=2, device=device
    )
