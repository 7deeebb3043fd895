"""Tiny fp32 decoder models and prompts for the rollout tests.

Random-init models tend to repeat one token, which hides frozen positions and stale masks. A
large ``initializer_range`` and a tiny vocabulary give outputs that change token by token;
:func:`distinct_tokens_per_row` lets tests assert that they do.
"""

from __future__ import annotations

import functools

import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 128
PAD = 0
EOS = 1
HIDDEN = 64
#: Init std per family: GPT-2 / OPT (learned positions, LayerNorm) need a larger one than the
#: rotary families before greedy outputs stop repeating a single token.
ROTARY_FAMILIES = ("llama", "qwen2", "mistral", "phi3", "gemma")
INIT = {"gpt2": 1.0, "opt": 1.0} | dict.fromkeys(ROTARY_FAMILIES, 0.3)
#: The families every-family tests run (phi3 and gemma are built for the tests that name them).
FAMILIES = ("gpt2", "llama", "qwen2", "opt", "mistral")


def _build(family: str, attn: str = "sdpa", **overrides: object) -> torch.nn.Module:
    common = {
        "vocab_size": VOCAB,
        "pad_token_id": PAD,
        "eos_token_id": EOS,
        "bos_token_id": 2,
        "attn_implementation": attn,
    }
    common.update(overrides)
    if family == "gpt2":
        config = GPT2Config(
            n_embd=HIDDEN,
            n_layer=2,
            n_head=4,
            n_positions=64,
            initializer_range=INIT[family],
            **common,
        )
        cls = GPT2LMHeadModel
    elif family == "opt":
        config = OPTConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=128,
            max_position_embeddings=64,
            word_embed_proj_dim=HIDDEN,
            init_std=INIT[family],
            **common,
        )
        cls = OPTForCausalLM
    else:
        config_cls, cls = {
            "llama": (LlamaConfig, LlamaForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM),
            "phi3": (Phi3Config, Phi3ForCausalLM),
            "gemma": (GemmaConfig, GemmaForCausalLM),
        }[family]
        kwargs = {
            "hidden_size": HIDDEN,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            "initializer_range": INIT[family],
            "tie_word_embeddings": False,
        }
        if family == "mistral":
            kwargs["sliding_window"] = None
        if family == "gemma":  # its default head size (256) is wider than the model
            kwargs["head_dim"] = HIDDEN // 4
        kwargs.update(common)
        config = config_cls(**kwargs)
    torch.manual_seed(1234)
    model = cls(config).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


@functools.cache
def _cached(family: str, attn: str, overrides: tuple) -> torch.nn.Module:
    return _build(family, attn, **dict(overrides))


def tiny_model(family: str, attn: str = "sdpa", fresh: bool = False, **overrides: object):
    """A 2-layer, hidden-64, vocab-128 fp32 model; cached unless ``fresh`` (tests that mutate)."""
    if fresh:
        return _build(family, attn, **overrides)
    return _cached(family, attn, tuple(sorted(overrides.items())))


def prompts(batch: int, width: int = 6, seed: int = 0, padded: bool = True):
    """Left-padded prompts: row ``i`` has ``width - (i % 3)`` real tokens (ids 3..VOCAB-1)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, width), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        for row in range(batch):
            pad = row % 3
            ids[row, :pad] = PAD
            mask[row, :pad] = 0
    return ids, mask


def distinct_tokens_per_row(result, min_distinct: int = 3) -> bool:
    """Whether every row's response has at least ``min_distinct`` different tokens."""
    width = result.sequences.shape[1] - result.response_mask.shape[1]
    for row, length in enumerate(result.response_lengths.tolist()):
        tokens = result.sequences[row, width : width + length]
        if len(set(tokens.tolist())) < min_distinct:
            return False
    return True


def generate_padded(model, ids, mask, total: int, **kwargs) -> torch.Tensor:
    """``model.generate`` output padded with PAD to ``total`` columns."""
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            pad_token_id=PAD,
            eos_token_id=kwargs.pop("eos_token_id", EOS),
            **kwargs,
        )
    pad = torch.full((out.shape[0], total - out.shape[1]), PAD, dtype=out.dtype)
    return torch.cat([out, pad], dim=1)


def make_engine(model, graph: bool = True, backend=None, **config):
    """The tests' one engine factory: CPU reference backend unless ``backend`` is given."""
    from graphcap.cpu import CPUBackend
    from graphcap.rollout import RolloutConfig, RolloutEngine

    config = RolloutConfig(enable_graph_capture=graph, backend=backend or CPUBackend(), **config)
    return RolloutEngine(model, config)


def run(model, ids, mask, graph: bool, backend=None, generator=None, **sampling):
    """One ``generate`` call on a fresh engine (CPU reference backend unless given)."""
    from graphcap.rollout import SamplingParams

    engine = make_engine(model, graph, backend)
    result = engine.generate(ids, mask, SamplingParams(**sampling), generator=generator)
    engine.shutdown()
    return result


def assert_rows_equal_alone(model, ids, mask, result, limits, sampling=lambda row: {}):
    """Each row of a continuous ``result`` equals its request decoded alone by the eager loop
    (``max_new_tokens=limits[row]`` and ``sampling(row)``), tokens and finish reason."""
    width = ids.shape[1]
    for row, limit in enumerate(limits):
        alone = run(
            model,
            ids[row : row + 1],
            mask[row : row + 1],
            False,
            max_new_tokens=limit,
            **sampling(row),
        )
        assert torch.equal(result.sequences[row, : width + limit], alone.sequences[0]), row
        assert result.finish_reasons[row] == alone.finish_reasons[0], row
