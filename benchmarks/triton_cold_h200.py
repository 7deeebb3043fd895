"""Where the split-KV kernel's first launch spends its time on a cold Triton cache (issue 11,
run W): the default graph mode's first call pays it once per machine.

    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/triton_cold_h200.py

llama-8b's decode shape at batch 1 (32 query / 8 K/V heads of 128, 640 columns, bf16): the
first launch under cProfile (the 25 costliest calls by cumulative time), then a second launch.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch
from graphcap_cuda.split_kv import split_kv_decode

q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 8, 640, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
mask = torch.ones(1, 640, dtype=torch.bool, device="cuda")
torch.cuda.synchronize()
profile = cProfile.Profile()
start = time.perf_counter()
profile.runcall(split_kv_decode, q, k, v, mask, 128**-0.5, 0.0)
torch.cuda.synchronize()
print(f"first launch {time.perf_counter() - start:.3f} s")
start = time.perf_counter()
split_kv_decode(q, k, v, mask, 128**-0.5, 0.0)
torch.cuda.synchronize()
print(f"second launch {time.perf_counter() - start:.4f} s")
pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
