"""Tiny fp32 decoder models and left-padded prompts: the one fixture of the conformance suite,
the tests, the examples and the benchmarks.

Two layers, hidden 64: a forward costs well under a millisecond on a CPU. Random-init models
tend to repeat one token, which hides frozen positions and stale masks, so the init std is large
(:data:`INIT`) and the vocabulary tiny: greedy outputs change token by token. It needs only
torch and transformers (no pytest), so examples can import it.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
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
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB, PAD, EOS, BOS = 128, 0, 1, 2
HIDDEN = 64
#: The seed every model is built under unless a caller picks another.
SEED = 1234
#: Init std per family: GPT-2 / OPT (learned positions, LayerNorm) need a larger one than the
#: rotary families before greedy outputs stop repeating a single token.
ROTARY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2")
INIT = {"gpt2": 1.0, "opt": 1.0} | dict.fromkeys(ROTARY_FAMILIES, 0.3)
_ROTARY_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "gemma": (GemmaConfig, GemmaForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
}


def tiny_model(
    family: str = "llama",
    attn: str = "sdpa",
    *,
    vocab_size: int = VOCAB,
    seed: int = SEED,
    **overrides: object,
) -> torch.nn.Module:
    """A 2-layer, hidden-64 fp32 model of ``family`` (gpt2, opt, llama, qwen2, qwen3, mistral,
    phi3, gemma, gemma2) with weights drawn under ``seed``, in eval mode on the current default
    device; ``overrides`` are config fields (sizes, token ids). Its generation config carries
    the config's pad and EOS ids."""
    common: dict[str, object] = {
        "vocab_size": vocab_size,
        "pad_token_id": PAD,
        "eos_token_id": EOS,
        "bos_token_id": BOS,
        "attn_implementation": attn,
    }
    if family == "gpt2":
        fields = {"n_embd": HIDDEN, "n_layer": 2, "n_head": 4, "n_positions": 64}
        config: PretrainedConfig = GPT2Config(
            **fields | {"initializer_range": INIT[family]} | common | overrides
        )
        cls: type[PreTrainedModel] = GPT2LMHeadModel
    elif family == "opt":
        fields = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4}
        fields |= {"ffn_dim": 128, "max_position_embeddings": 64, "word_embed_proj_dim": HIDDEN}
        config = OPTConfig(**fields | {"init_std": INIT[family]} | common | overrides)
        cls = OPTForCausalLM
    else:
        config_cls, cls = _ROTARY_CLASSES[family]
        fields = {
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
            fields["sliding_window"] = None
        if family in ("gemma", "gemma2", "qwen3"):  # default head sizes are wider than the model
            fields["head_dim"] = HIDDEN // 4
        config = config_cls(**fields | common | overrides)
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def prompts(
    batch: int,
    width: int = 6,
    *,
    vocab_size: int = VOCAB,
    seed: int = 0,
    pad_cycle: int = 3,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of ids 3..vocab_size-1 (row ``i`` has ``i % pad_cycle`` pads; a
    cycle of 1 pads nothing), and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch, width), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(batch):
        ids[row, : row % pad_cycle] = PAD
        mask[row, : row % pad_cycle] = 0
    if device is None:
        return ids, mask
    return ids.to(device), mask.to(device)
