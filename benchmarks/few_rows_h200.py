"""graphcap_cuda's few-row product kernel against cuBLAS on one H200 (issue 11, run V), before it
was wired into the decode step.

    python3 benchmarks/few_rows_h200.py RESULTS.json

Each llama-8b and llama-1b projection (joined q/k/v, o, joined gate/up, down, LM head) at 8,
16, 32 and 64 rows, bf16: cuBLAS (``F.linear``), the kernel with its default tiling, and a sweep
of tilings (at 64 rows a wide one, below it a narrow one). One CUDA graph replays the product
over enough weight copies to outgrow the L2 cache (the kernel's launches dependent, as in a
step); the time is the median of 20 replays divided by the copies. ``step_us`` adds a step's
products (every layer's and the LM head) per setting: cuBLAS, the default tiling, and the best
tiling of each product.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from decode_levers_h200 import PROJECTIONS
from graphcap_cuda import few_rows
from split_kv_h200 import HBM_BYTES_PER_S

LAYERS = {"llama-8b": 32, "llama-1b": 16}
ROWS = (64, 32, 16, 8)
#: Bytes of weights each timing reads (the H200's L2 cache holds 60 MB).
READ_BYTES = 1 << 30
WIDE = {"block_n": (32, 64, 128), "block_k": (64, 128, 256), "stages": (3, 5), "pps": (1, 2, 4)}
NARROW = {"block_n": (64, 128), "block_k": (128, 256), "stages": (4,), "pps": (1, 2, 4)}


def replay_us(fn, x, weights) -> float:
    """Median time of one product over the weight copies, from CUDA-graph replays."""
    for w in weights[:2]:
        fn(x, w)  # compiles and checks the launch before the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        outs = [fn(x, w) for w in weights]
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3 / len(weights))
    del outs, graph
    return sorted(times)[len(times) // 2]


def launch(x, weight, shape):
    return few_rows.launch_few_rows(x, weight, None, shape)


def tiled(rows: int, n: int, k: int, block_n: int, block_k: int, stages: int, pps: int):
    tiles = math.ceil(n / block_n)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    split = max(1, min(math.ceil(k / block_k), math.ceil(pps * sms / tiles)))
    return few_rows.Tiling(block_n, block_k, split, stages, 8 if block_n >= 128 else 4)


def product_rows(model: str, name: str, n: int, k: int, rows: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    copies = max(2, math.ceil(READ_BYTES / (n * k * 2)))
    weights = [
        torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * k**-0.5
        for _ in range(copies)
    ]
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    exact = F.linear(x.double(), weights[0].double())
    default = few_rows.few_rows(x, weights[0])
    row = {
        "model": model,
        "product": name,
        "n": n,
        "k": k,
        "rows": rows,
        "copies": copies,
        "default_tiling": few_rows.tiling(rows, n, k, x.device)._asdict(),
        "max_abs_err_default": (default.double() - exact).abs().max().item(),
        "max_abs_err_cublas": (F.linear(x, weights[0]).double() - exact).abs().max().item(),
        "cublas_us": replay_us(F.linear, x, weights),
        "default_us": replay_us(few_rows.few_rows, x, weights),
        "sweep": [],
    }
    grid = WIDE if rows == 64 else NARROW
    for block_n, block_k, stages, pps in itertools.product(*grid.values()):
        shape = tiled(rows, n, k, block_n, block_k, stages, pps)
        try:
            us = replay_us(functools.partial(launch, shape=shape), x, weights)
        except Exception as exc:  # out of shared memory for the deepest pipelines
            row["sweep"].append({**shape._asdict(), "pps": pps, "error": type(exc).__name__})
            continue
        row["sweep"].append({**shape._asdict(), "pps": pps, "us": us})
    timed = [s for s in row["sweep"] if "us" in s]
    row["best"] = min(timed, key=lambda s: s["us"])
    for key in ("cublas", "default"):
        row[f"{key}_bandwidth"] = n * k * 2 / (row[f"{key}_us"] * 1e-6) / HBM_BYTES_PER_S
    print(
        f"{model} {name} rows {rows}: cuBLAS {row['cublas_us']:.1f} us, default "
        f"{row['default_us']:.1f} ({row['default_bandwidth']:.0%}), best {row['best']['us']:.1f} "
        f"{row['best']}; err {row['max_abs_err_default']:.2e} vs cuBLAS "
        f"{row['max_abs_err_cublas']:.2e}",
        flush=True,
    )
    del weights
    torch.cuda.empty_cache()
    return row


def main(path: str) -> None:
    started = time.perf_counter()
    rows, steps = [], []
    for model, products in PROJECTIONS.items():
        for count in ROWS:
            found = [product_rows(model, n, *nk, count) for n, nk in products.items()]
            rows += found
            times = {"cublas": 0.0, "default": 0.0, "best": 0.0}
            for r in found:
                each = 1 if r["product"] == "lm_head" else LAYERS[model]
                times["cublas"] += each * r["cublas_us"]
                times["default"] += each * r["default_us"]
                times["best"] += each * r["best"]["us"]
            steps.append({"model": model, "rows": count, "step_us": times})
            print(f"{model} rows {count}: a step's products {times}", flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": rows,
        "steps": steps,
        "elapsed_s": time.perf_counter() - started,
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
