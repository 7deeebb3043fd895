"""Where the host time of a graph-path call goes: cProfile over repeated calls.

    python benchmarks/host_overhead_h200.py [MODEL] [DTYPE]     (GRAPHCAP_BACKEND=cuda)

gpt2-medium fp16 by default, batch 1, 32 prompt + 32 new tokens, EOS off; 3 warm-up calls,
then 10 profiled graph-path calls. Prints the call's wall time split (prefill, decode, the rest)
and the graphcap functions by own time.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys

import torch

from graphcap import get_backend
from graphcap.bench.models import DTYPES, build_model
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams


def main(name: str = "gpt2-medium", dtype: str = "fp16") -> None:
    backend = get_backend()
    model = build_model(name, dtype=DTYPES[dtype], device=backend.device, seed=0)
    ids = torch.randint(3, model.config.vocab_size, (1, 32), device=backend.device)
    mask = torch.ones_like(ids)
    params = SamplingParams(max_new_tokens=32, eos_token_id=[], pad_token_id=0)
    engine = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=backend))
    for _ in range(3):
        engine.generate(ids, mask, params)
    profile = cProfile.Profile()
    results = []
    profile.enable()
    for _ in range(10):
        results.append(engine.generate(ids, mask, params).stats)
    profile.disable()
    med = {k: statistics.median(getattr(s, k) for s in results) * 1e3 for k in
           ("total_s", "prefill_s", "decode_s")}  # fmt: skip
    print(f"{name} {dtype}: per call (ms, median of 10): {med}, path {results[-1].path}")
    rest = med["total_s"] - med["prefill_s"] - med["decode_s"]
    print(f"host time outside prefill and decode: {rest:.2f} ms")
    stats = pstats.Stats(profile).sort_stats("tottime")
    stats.print_stats(r"graphcap|transformers", 30)
    stats.sort_stats("cumulative").print_stats(r"graphcap", 30)


if __name__ == "__main__":
    main(*sys.argv[1:])
