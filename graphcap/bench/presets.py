"""Benchmark models: random-weight presets built from configs, or a local model directory.

Nothing can be downloaded here, so presets reproduce the *shapes* of real checkpoints (weights
are what a decode step reads, so the shape is what the timing depends on). Random weights at
transformers' default initialisation make a greedy model repeat one token, which would make the
token-agreement check vacuous; presets therefore initialise with a larger, width-scaled standard
deviation (``INIT_SCALE / sqrt(hidden)``), which gives varied, context-dependent tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
)

#: Weight init std is INIT_SCALE / sqrt(hidden): large enough that random models do not collapse
#: onto one repeated token, small enough that 32 layers stay finite in fp16/bf16.
INIT_SCALE = 2.0

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class Preset:
    """A named model shape; ``family`` picks the default accelerator dtype."""

    name: str
    family: str
    description: str
    make_config: Callable[[], PretrainedConfig]


def _init_std(hidden: int) -> float:
    return INIT_SCALE / math.sqrt(hidden)


def _gpt2(n_embd: int, n_layer: int, n_head: int, vocab: int, positions: int) -> GPT2Config:
    # No EOS/BOS: ids outside a small vocabulary would be invalid, and benchmarks ignore EOS.
    return GPT2Config(
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        vocab_size=vocab,
        n_positions=positions,
        initializer_range=_init_std(n_embd),
        bos_token_id=None,
        eos_token_id=None,
    )


def _llama(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    tied: bool,
    positions: int = 8192,
) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=positions,
        initializer_range=_init_std(hidden),
        bos_token_id=None,
        eos_token_id=None,
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny-gpt2",
            "gpt2",
            "GPT-2 architecture, 4 layers x 256 wide, vocab 8192 (CPU-sized)",
            lambda: _gpt2(256, 4, 8, 8192, 1024),
        ),
        Preset(
            "tiny-llama",
            "llama",
            "Llama architecture, 4 layers x 256 wide, GQA 8/4 heads, vocab 8192 (CPU-sized)",
            lambda: _llama(256, 4, 8, 4, 688, 8192, tied=False, positions=2048),
        ),
        Preset(
            "gpt2-medium",
            "gpt2",
            "GPT-2 medium shape: 24 layers x 1024, 16 heads, vocab 50257 (~355M parameters)",
            lambda: _gpt2(1024, 24, 16, 50257, 1024),
        ),
        Preset(
            "llama-1b",
            "llama",
            "Llama-3.2-1B shape: 16 layers x 2048, GQA 32/8, MLP 8192, vocab 128256, tied",
            lambda: _llama(2048, 16, 32, 8, 8192, 128256, tied=True),
        ),
        Preset(
            "llama-8b",
            "llama",
            "Llama-3-8B shape: 32 layers x 4096, GQA 32/8, MLP 14336, vocab 128256",
            lambda: _llama(4096, 32, 32, 8, 14336, 128256, tied=False),
        ),
    )
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def default_dtype_name(model: str, device_type: str) -> str:
    """fp32 on CPU; fp16 for GPT-2 shapes and bf16 otherwise on accelerators."""
    if device_type == "cpu":
        return "fp32"
    preset = PRESETS.get(model)
    return "fp16" if preset is not None and preset.family == "gpt2" else "bf16"


def disable_eos(model: PreTrainedModel, pad_token_id: int = 0) -> None:
    """Make every mode generate exactly ``max_new_tokens`` the same plain greedy way.

    Timing comparisons need equal work per mode, and token agreement is only meaningful when
    no row stops early on a random model's accidental EOS. A local checkpoint's generation
    defaults (sampling, repetition penalty, ...) are dropped too: ``generate`` would apply them
    and graphcap's engine, given explicit settings, would not.
    """
    model.config.eos_token_id = None
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=pad_token_id)


def build_model(
    model: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    backend_seed: Callable[[int], None] | None = None,
) -> PreTrainedModel:
    """A preset (random weights, seeded) or a local model directory, in eval mode on ``device``.

    ``backend_seed`` seeds the device generator too, so weights initialised on the device are
    reproducible; presets are built directly on the device (an 8B model initialised on the host
    in fp32 would take minutes and 32 GB).
    """
    torch.manual_seed(seed)
    if backend_seed is not None:
        backend_seed(seed)
    preset = PRESETS.get(model)
    if preset is not None:
        with torch.device(device):
            built = AutoModelForCausalLM.from_config(preset.make_config(), dtype=dtype)
    else:
        built = _load_local(model, dtype).to(device)
    built.eval()
    disable_eos(built)
    return built


def _load_local(path: str, dtype: torch.dtype) -> PreTrainedModel:
    directory = Path(path)
    if not directory.is_dir() or not (directory / "config.json").is_file():
        raise ValueError(
            f"--model {path!r} is neither a preset ({', '.join(PRESETS)}) nor a local model "
            "directory containing config.json; nothing is downloaded, so pass a preset name or "
            "the path of a model saved with save_pretrained()"
        )
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)


def describe_model(model: PreTrainedModel) -> dict[str, Any]:
    """Shape facts for the report (architecture, sizes, parameter count)."""
    config = model.config
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
    )
    shape = {k: getattr(config, k) for k in keys if getattr(config, k, None) is not None}
    return {
        "architecture": type(model).__name__,
        # parameters() yields a tied weight once, so this is the number of distinct weights.
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        **shape,
    }
