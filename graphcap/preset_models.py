"""Random-weight models with the shapes of real checkpoints (llama-1b, llama-8b, ...): what the
benchmarks, the examples and the distributed scripts run when nothing can be downloaded. A step's
cost is set by the shape, so the presets stand for their checkpoints in speed; their weights have a
std of ``INIT_SCALE / sqrt(hidden)``: at transformers' default a greedy random model repeats one
token, making agreement between modes vacuous."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

#: Large enough that random models do not collapse onto one token, small enough that 32 layers
#: stay finite in fp16/bf16.
INIT_SCALE = 2.0
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
SHAPE += ("intermediate_size", "vocab_size", "tie_word_embeddings")
#: name: (model type, the SHAPE fields in order); docs/benchmarks.md describes each.
PRESETS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "tiny-gpt2": ("gpt2", (256, 4, 8, None, None, 8192, True)),
    "tiny-llama": ("llama", (256, 4, 8, 4, 688, 8192, False)),
    "gpt2-medium": ("gpt2", (1024, 24, 16, None, None, 50257, True)),  # ~355M parameters
    "llama-1b": ("llama", (2048, 16, 32, 8, 8192, 128256, True)),  # Llama-3.2-1B
    "llama-8b": ("llama", (4096, 32, 32, 8, 14336, 128256, False)),  # Llama-3-8B
}


def preset_config(name: str) -> Any:
    """The transformers config of a preset; no BOS/EOS (benchmarks ignore EOS)."""
    model_type, values = PRESETS[name]
    shape = {k: v for k, v in zip(SHAPE, values, strict=True) if v is not None}
    config = AutoConfig.for_model(model_type, **shape, bos_token_id=None, eos_token_id=None)
    config.initializer_range = INIT_SCALE / math.sqrt(config.hidden_size)
    return config


def default_dtype_name(model: str, device_type: str) -> str:
    """fp32 on CPU; fp16 for GPT-2 shapes and bf16 otherwise on accelerators."""
    gpt2 = PRESETS.get(model, ("",))[0] == "gpt2"
    return "fp32" if device_type == "cpu" else "fp16" if gpt2 else "bf16"


def build_model(
    model: str, *, dtype: torch.dtype, device: torch.device, seed: int = 0, backend_seed: Any = None
) -> PreTrainedModel:
    """A preset (random weights, built on the device) or a local model directory, with EOS off
    so that every mode generates exactly ``max_new_tokens``; on the meta device, shapes only
    (a local model's weights are not read)."""
    torch.manual_seed(seed)
    if backend_seed is not None:
        backend_seed(seed)
    local = (Path(model) / "config.json").is_file()
    if model in PRESETS or (local and device.type == "meta"):  # a meta model reads no weights
        with torch.device(device):
            preset = model in PRESETS
            config = preset_config(model) if preset else AutoConfig.from_pretrained(model)
            built = AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif local:
        built = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, local_files_only=True)
        built = built.to(device)
    else:
        raise ValueError(
            f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory "
            "with config.json (from save_pretrained(); nothing is downloaded)"
        )
    built.eval().config.eos_token_id = None
    built.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)
    return built
