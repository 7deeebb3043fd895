"""The one-row kernel of two trees timed alike (issue 11, run Z): llama-8b's (or llama-1b's)
batch-1 products of every layer chained in one CUDA graph as a step runs them (dependent
launches on where the kernels use them), over weights far larger than the L2 cache.

    git show REV:backends/cuda/graphcap_cuda/gemv.py > /tmp/gemv_base.py
    python benchmarks/gemv_ab_h200.py OUT.json /tmp/gemv_base.py [--model llama-8b] [--sweep]

Variants: cuBLAS (``F.linear``), the base tree's kernel, this tree's kernel, and this tree's
kernel with the gated MLP's activation and the residual add in it (graphcap_cuda.epilogues);
the products alone (no elementwise work), gate/up plain and, with ``--sweep``, gated under
settings of rows, warps and columns a load.
The base file's op is renamed on load so both kernels coexist in one process.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from graphcap_cuda import gemv

SHAPES = {  # hidden, q/k/v rows, intermediate, layers
    "llama-8b": (4096, 6144, 14336, 32),
    "llama-1b": (2048, 3072, 8192, 16),
}


def load_base(path: str):
    source = Path(path).read_text().replace("graphcap_cuda::gemv", "graphcap_base::gemv")
    copy = Path(tempfile.mkdtemp()) / "gemv_base.py"
    copy.write_text(source)
    spec = importlib.util.spec_from_file_location("gemv_base", copy)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gemv_base"] = module  # Triton's JIT reads the kernel's module
    spec.loader.exec_module(module)
    return module


def step(layers, x, product, fused: bool):
    """Every layer's q/k/v, o, gate/up and down products, each fed by the last."""
    for qkv, o, gate_up, down in layers:
        h = product(x, qkv)[..., : o.shape[1]]
        h = product(h, o)
        half = down.shape[1]
        if fused:
            x = gemv.gemv(gemv.gemv(h, gate_up[half:], None, None, gate_up[:half]), down, None, h)
        else:
            a = product(h, gate_up)
            x = product(F.silu(a[..., :half]) * a[..., half:], down) + h
    return x


def products(layers, x, gated: dict | None):
    """The products alone, no elementwise work between them: gate/up as one product, or gated
    with ``gated`` settings (rows of each half per program, warps, columns a load) for the
    gated kernel: the step's kernels, inductor's aside."""
    saved = gemv.block_rows, gemv.NUM_WARPS, gemv.BLOCK_K, gemv.GATED_BLOCK_K
    for qkv, o, gate_up, down in layers:
        h = gemv.gemv(gemv.gemv(x, qkv)[..., : o.shape[1]], o)
        half = down.shape[1]
        if gated is None:
            a = gemv.gemv(h, gate_up)[..., :half]
        else:
            gemv.block_rows = lambda n, device: gated["rows"]
            gemv.NUM_WARPS, gemv.BLOCK_K = gated["warps"], gated["block_k"]
            gemv.GATED_BLOCK_K = gated["block_k"]
            a = gemv.gemv(h, gate_up[half:], None, None, gate_up[:half])
            gemv.block_rows, gemv.NUM_WARPS, gemv.BLOCK_K, gemv.GATED_BLOCK_K = saved
        x = gemv.gemv(a, down, None, None if gated is None else h)
    return x


def replay_ms(fn, repeats: int = 20) -> list[float]:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("base")
    parser.add_argument("--model", default="llama-8b")
    parser.add_argument("--sweep", action="store_true", help="the gated kernel's settings too")
    args = parser.parse_args()
    base = load_base(args.base)
    hidden, qkv_rows, inter, count = SHAPES[args.model]

    def weights(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * cols**-0.5

    layers = [
        (weights(qkv_rows, hidden), weights(hidden, hidden), weights(2 * inter, hidden),
         weights(hidden, inter))
        for _ in range(count)
    ]  # fmt: skip
    x = torch.randn(1, 1, hidden, device="cuda", dtype=torch.bfloat16)
    variants = {
        "cublas": lambda: step(layers, x, F.linear, False),
        "base": lambda: step(layers, x, base.gemv, False),
        "tree": lambda: step(layers, x, gemv.gemv, False),
        "tree_fused": lambda: step(layers, x, gemv.gemv, True),
        "products_plain": lambda: products(layers, x, None),
    }
    sweep = itertools.product((2, 4, 8), (4, 8), (256, 512)) if args.sweep else ()
    for rows, warps, block_k in sweep:
        settings = {"rows": rows, "warps": warps, "block_k": block_k}
        name = f"products_gated_{rows}_w{warps}_k{block_k}"
        variants[name] = functools.partial(products, layers, x, settings)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(2):  # two rounds, interleaved, against drift
        for name, fn in variants.items():
            times[name] += replay_ms(fn)
    summary = {n: statistics.median(t) for n, t in times.items()}
    report = {"model": args.model, "base": args.base, "ms": times, "median_ms": summary}
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
