"""Per-call cost of the graph signature's host-state fingerprint (docs/rollout-mechanism.md).

Builds Llama-3-8B's module tree on the meta device (no weights allocated) and the tests' tiny
Llama, then times ``host_state(model)`` (taken on every generate call), comparing two
fingerprints, and the signature's tensor facts for scale.

    python benchmarks/host_state_cost.py
"""

from __future__ import annotations

import timeit

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from graphcap.rollout.plan.fingerprint import host_state
from graphcap.rollout.plan.scan import scan_model
from graphcap.tiny_models import tiny_model

LLAMA_3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}


def best_ms(fn, number: int = 100) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e3


def main() -> None:
    builders = {
        "llama-3-8b (meta)": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA_3_8B)),
        "tiny llama": tiny_model,
    }
    for name, build in builders.items():
        with torch.device("meta"):
            model = build()
        first, second = host_state(model), host_state(model)
        modules = sum(1 for _ in model.modules())
        take = best_ms(lambda m=model: host_state(m))
        compare = best_ms(lambda a=first, b=second: a == b)
        scan = best_ms(lambda m=model: scan_model(m))
        print(
            f"{name}: {modules} modules; host_state {take:.2f} ms, compare {compare:.3f} ms, "
            f"the whole per-call scan (host_state included) {scan:.2f} ms"
        )


if __name__ == "__main__":
    main()
