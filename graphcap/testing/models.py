"""Tiny fp32 GPT-2 and Llama models and left-padded prompts for the conformance checks.

Two layers, hidden 64, vocabulary 96: a forward costs well under a millisecond on a CPU, so the
engine-level checks stay cheap. A large init std makes greedy tokens change step by step, which a
frozen position or a stale mask would visibly break.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB, PAD, EOS, BOS = 96, 0, 1, 2


def tiny_gpt2(attn: str = "sdpa") -> torch.nn.Module:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        initializer_range=1.0,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
        attn_implementation=attn,
    )
    return GPT2LMHeadModel(config)


def tiny_llama(attn: str = "sdpa") -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config)


MODELS: dict[str, Callable[..., torch.nn.Module]] = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def build(name: str, device: torch.device, attn: str = "sdpa") -> torch.nn.Module:
    """The named tiny model with fixed weights, in eval mode on ``device``."""
    torch.manual_seed(1234)
    model = MODELS[name](attn).eval().to(device)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


def prompts(
    batch: int, device: torch.device, width: int = 5, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (row ``i`` has ``i % 2`` pads) of ids 3..VOCAB-1, and their mask."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, width), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(batch):
        ids[row, : row % 2] = PAD
        mask[row, : row % 2] = 0
    return ids.to(device), mask.to(device)
