"""llama-8b's batch-256 products through inductor's CUTLASS backend: the lever the issue named
for the batch-256 step that cuBLAS, TunableOp and inductor's Triton templates left at 11 ms.

    TORCHINDUCTOR_CUTLASS_DIR=DIR python3 cutlass-gemms.py OUT.json [CONFIGS]

For each product of a joined llama-8b step at 256 rows (q/k/v 4096 -> 6144, o 4096 -> 4096,
gate/up 4096 -> 28672, down 14336 -> 4096), ``F.linear`` compiled with max-autotune over
CUTLASS's kernels and cuBLAS (``max_autotune_gemm_backends="CUTLASS,ATEN"``, at most CONFIGS
CUTLASS configurations profiled a product, default 6; inductor prints each candidate's time to
stderr), then the compiled product against ``F.linear`` on cuBLAS and on cuBLASLt, each timed
as a CUDA graph over copies of its weights that outgrow the L2 cache, microseconds a call
(median and min-max of 20 replays). DIR is a CUTLASS tree as inductor wants it (``include``,
``tools``, ``python/cutlass_library``, ``python/cutlass_cppgen``, ``python/pycute``): the
``nvidia-cutlass`` wheel's packages and its ``cutlass_library/source``. A diagnostic kept beside
its output.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch._inductor import config

ROWS = 256
PRODUCTS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
L2_OUTGROW_BYTES = 400 * 2**20


def per_call_us(fn, xs, ws, replays=20):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x, w in zip(xs, ws, strict=True):
            fn(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w in zip(xs, ws, strict=True):
            fn(x, w)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(xs))
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def linear(x, w):
    return F.linear(x, w)


def cublas(library):
    def on_library(x, w):
        torch.backends.cuda.preferred_blas_library(library)
        return F.linear(x, w)

    return on_library


def main() -> None:
    out, configs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6
    config.max_autotune_gemm = True
    config.max_autotune_gemm_backends = "CUTLASS,ATEN"
    for section in ("cuda", "cutlass"):
        if hasattr(config, section):
            getattr(config, section).cutlass_max_profiling_configs = configs
    result = {"rows": ROWS, "cutlass_configs": configs, "torch": torch.__version__, "products": {}}
    for name, (k, n) in PRODUCTS.items():
        copies = max(2, math.ceil(L2_OUTGROW_BYTES / (k * n * 2)))
        gen = torch.Generator(device="cuda").manual_seed(0)
        ws = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            for _ in range(copies)
        ]
        xs = [
            torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(copies)
        ]
        torch._dynamo.reset()
        compiled = torch.compile(linear, dynamic=False)
        print(f"== {name}: {ROWS}x{k} @ {k}x{n}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        got = compiled(xs[0], ws[0])
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        torch.backends.cuda.preferred_blas_library("cublas")
        error = (got.float() - F.linear(xs[0], ws[0]).float()).abs().max().item()
        row = {
            "k": k,
            "n": n,
            "copies": copies,
            "compile_s": round(compile_s, 1),
            "max_abs_diff_vs_cublas": error,
            "us": {
                "cublas": per_call_us(cublas("cublas"), xs, ws),
                "cublaslt": per_call_us(cublas("cublaslt"), xs, ws),
                "max_autotune_cutlass_aten": per_call_us(compiled, xs, ws),
            },
        }
        torch.backends.cuda.preferred_blas_library("cublas")
        flops = 2 * ROWS * k * n
        for times in row["us"].values():
            times["tflops"] = round(flops / (times["median"] * 1e-6) / 1e12, 1)
        result["products"][name] = row
        print(json.dumps({name: row["us"]}), file=sys.stderr, flush=True)
        with open(out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
