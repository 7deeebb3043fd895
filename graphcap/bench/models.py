"""Benchmark models, prompts and the weight-bandwidth roofline.

Nothing can be downloaded here, so presets reproduce the *shapes* of real checkpoints (weights
are what a decode step reads, so the shape is what the timing depends on). Random weights at
transformers' default initialisation make a greedy model repeat one token, which would make the
token-agreement check vacuous; presets therefore initialise with a larger, width-scaled standard
deviation (``INIT_SCALE / sqrt(hidden)``), which gives varied, context-dependent tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from graphcap.backend import Backend

#: Weight init std is INIT_SCALE / sqrt(hidden): large enough that random models do not collapse
#: onto one repeated token, small enough that 32 layers stay finite in fp16/bf16.
INIT_SCALE = 2.0

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _gpt2(n_embd: int, n_layer: int, n_head: int, vocab: int) -> GPT2Config:
    # No EOS/BOS: ids outside a small vocabulary would be invalid, and benchmarks ignore EOS.
    std = INIT_SCALE / math.sqrt(n_embd)
    return GPT2Config(
        n_embd=n_embd, n_layer=n_layer, n_head=n_head, vocab_size=vocab, n_positions=1024,
        initializer_range=std, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def _llama(
    hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int, tied: bool
) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=mlp, vocab_size=vocab,
        tie_word_embeddings=tied, max_position_embeddings=8192,
        initializer_range=INIT_SCALE / math.sqrt(hidden), bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


#: Named model shapes (docs/benchmarks.md lists them); a GPT-2 shape defaults to fp16 on devices.
PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-gpt2": lambda: _gpt2(256, 4, 8, 8192),  # CPU-sized
    "tiny-llama": lambda: _llama(256, 4, 8, 4, 688, 8192, tied=False),  # CPU-sized, GQA
    "gpt2-medium": lambda: _gpt2(1024, 24, 16, 50257),  # ~355M parameters
    "llama-1b": lambda: _llama(2048, 16, 32, 8, 8192, 128256, tied=True),  # Llama-3.2-1B
    "llama-8b": lambda: _llama(4096, 32, 32, 8, 14336, 128256, tied=False),  # Llama-3-8B
}


def default_dtype_name(model: str, device_type: str) -> str:
    """fp32 on CPU; fp16 for GPT-2 shapes and bf16 otherwise on accelerators."""
    if device_type == "cpu":
        return "fp32"
    return "fp16" if model in PRESETS and PRESETS[model]().model_type == "gpt2" else "bf16"


def build_model(
    model: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    backend_seed: Callable[[int], None] | None = None,
) -> PreTrainedModel:
    """A preset (random weights, seeded) or a local model directory, greedy with EOS off.

    ``backend_seed`` seeds the device generator too: presets are built directly on the device
    (an 8B model initialised on the host in fp32 would take minutes and 32 GB). A local
    checkpoint's generation defaults (sampling, repetition penalty, EOS) are dropped, so that
    every mode generates exactly ``max_new_tokens`` the same plain greedy way.
    """
    torch.manual_seed(seed)
    if backend_seed is not None:
        backend_seed(seed)
    if model in PRESETS:
        with torch.device(device):
            built = AutoModelForCausalLM.from_config(PRESETS[model](), dtype=dtype)
    else:
        directory = Path(model)
        if not (directory / "config.json").is_file():
            raise ValueError(
                f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a local model "
                "directory containing config.json; nothing is downloaded, so pass a preset name "
                "or the path of a model saved with save_pretrained()"
            )
        built = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
        built = built.to(device)
    built.eval()
    built.config.eos_token_id = None
    built.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)
    return built


def describe_model(model: PreTrainedModel) -> dict[str, Any]:
    """Shape facts for the report (architecture, sizes, distinct parameter count)."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    keys += ("intermediate_size", "vocab_size", "tie_word_embeddings")
    shape = {
        k: getattr(model.config, k) for k in keys if getattr(model.config, k, None) is not None
    }
    return {
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),  # a tied weight counts once
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        **shape,
    }


def make_prompts(
    vocab_size: int, batch_size: int, prompt_len: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token prompts (full length, no padding), the same for every mode."""
    generator = torch.Generator().manual_seed(seed + batch_size)
    ids = torch.randint(0, vocab_size, (batch_size, prompt_len), generator=generator)
    return ids.to(device), torch.ones_like(ids).to(device)


# ---- memory-bandwidth roofline ----------------------------------------------------------------
# A decode step at small batch is bound by reading every weight once, so weight bytes / step time
# against the device's peak bandwidth says how much of the hardware a mode leaves on the table.

#: Peak memory bandwidth in bytes/s by device-name fragment (vendor datasheets); the first
#: fragment found (case-insensitively) in the device's name wins.
PEAK_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
)


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once, except lookup tables
    (``nn.Embedding``) that are not also the output projection (a step gathers a few rows);
    a tied input/output embedding is read in full by the output projection, counted once."""
    output = getattr(model.get_output_embeddings(), "weight", None)
    gathered = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, nn.Embedding) and m.weight is not output
    }
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in gathered)


def device_name(backend: Backend) -> str:
    """The name the device reports (e.g. "NVIDIA H200"), or the device type."""
    if backend.device.type != "cpu":
        try:
            return str(backend.device_module.get_device_name(backend.device))
        except Exception:  # not every device module has it (or takes a device); only cosmetic
            pass
    return backend.device.type


def peak_bandwidth(name: str, override: float | None = None) -> float | None:
    """Peak bytes/s for ``name``: the override, else the table (accelerators only), else None."""
    if override is not None and override <= 0:
        raise ValueError(f"--peak-bandwidth must be positive (bytes/s), got {override}")
    return override or next((bw for k, bw in PEAK_BANDWIDTH if k.lower() in name.lower()), None)


def parse_bandwidth(text: str) -> float:
    """Parse "4.8TB/s", "4800GB/s", "4.8e12" into bytes/s."""
    cleaned = text.strip().lower().removesuffix("/s").removesuffix("b")
    scale = {"t": 1e12, "g": 1e9, "m": 1e6}.get(cleaned[-1:], 1.0)
    try:
        return float(cleaned[:-1] if scale != 1.0 else cleaned) * scale
    except ValueError:
        raise ValueError(f"cannot read bandwidth {text!r}; write e.g. 4.8TB/s or 4.8e12") from None
