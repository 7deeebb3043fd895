"""First call of the graph path per attention on a cold Triton cache (issue 11): how much of it
is Triton compiling the split-KV kernel. llama-1b shape, bf16, 128 + 128 tokens, batch 1.

    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/first_call_attention.py

Order matters: the grouped-query SDPA engine first (it also pays the process's CUDA warm-up),
then two split-KV engines (the second finds the kernel compiled).
"""

from __future__ import annotations

import time

import torch

import graphcap
from graphcap.bench.models import build_model, make_prompts
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

backend = graphcap.get_backend("cuda")
model = build_model(
    "llama-1b", dtype=torch.bfloat16, device=backend.device, backend_seed=backend.manual_seed
)
ids, mask = make_prompts(model.config.vocab_size, 1, 128, 0, backend.device)
params = SamplingParams(max_new_tokens=128, eos_token_id=[], pad_token_id=0)
for attention in ("graphcap_gqa_sdpa", "graphcap_split_kv", "graphcap_split_kv"):
    config = RolloutConfig(enable_graph_capture=True, backend=backend, graph_attention=attention)
    engine = RolloutEngine(model, config)
    start = time.perf_counter()
    result = engine.generate(ids, mask, params)
    backend.synchronize()
    first = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate(ids, mask, params)
    backend.synchronize()
    steady = time.perf_counter() - start
    print(
        f"{attention}: first {first:.3f}s (capture {result.stats.capture_s:.3f}s) "
        f"steady {steady:.3f}s",
        flush=True,
    )
    engine.shutdown()
