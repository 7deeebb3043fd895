"""Greedy tokens and step times of the static graph path on two presets, for comparing trees.

    python benchmarks/tokens_h200.py OUT.json        (GRAPHCAP_BACKEND=cuda)

Runs against whichever graphcap is importable (this tree or an older checkout, so a redesign
can be checked for the same tokens as before it): gpt2-medium fp16 and llama-8b bf16, batch 1
and 8, 32 prompt + 32 new tokens, EOS off. Trees that offer ``RolloutConfig.graph_attention``
also run with it off (the model's own SDPA, as older trees always did) and on ("auto").
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time

import torch

from graphcap import get_backend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

try:  # the bench's preset builder moved between versions
    from graphcap.bench.models import DTYPES, build_model
except ImportError:
    from graphcap.bench.presets import build_model

    DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

CASES = (("gpt2-medium", "fp16"), ("llama-8b", "bf16"))


def main(out: str) -> None:
    backend = get_backend()
    has_attention = "graph_attention" in {f.name for f in dataclasses.fields(RolloutConfig)}
    variants = {"own": {"graph_attention": None}, "auto": {}} if has_attention else {"own": {}}
    report: dict[str, object] = {"cases": []}
    for name, dtype in CASES:
        model = build_model(
            name, dtype=DTYPES[dtype], device=backend.device, seed=0,
            backend_seed=backend.manual_seed,
        )  # fmt: skip
        for batch in (1, 8):
            gen = torch.Generator().manual_seed(batch)
            ids = torch.randint(3, model.config.vocab_size, (batch, 32), generator=gen)
            mask = torch.ones_like(ids)
            ids, mask = ids.to(backend.device), mask.to(backend.device)
            params = SamplingParams(max_new_tokens=32, eos_token_id=[], pad_token_id=0)
            for variant, extra in variants.items():
                config = RolloutConfig(enable_graph_capture=True, backend=backend, **extra)
                engine = RolloutEngine(model, config)
                results = [engine.generate(ids, mask, params) for _ in range(6)]
                steps = [r.stats.decode_s / max(r.stats.steps, 1) for r in results[1:]]
                report["cases"].append(
                    {
                        "model": name,
                        "dtype": dtype,
                        "batch": batch,
                        "variant": variant,
                        "path": results[-1].stats.path,
                        "first_call_s": results[0].stats.first_call_s,
                        "step_ms_median": statistics.median(steps) * 1e3,
                        "step_ms_min": min(steps) * 1e3,
                        "step_ms_max": max(steps) * 1e3,
                        "tokens": results[-1].sequences.cpu().tolist(),
                    }
                )
                engine.shutdown()
                print(name, batch, variant, f"{statistics.median(steps) * 1e3:.3f} ms/step")
        del model
        backend.empty_cache()
    report["when"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
