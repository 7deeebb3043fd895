"""Two decode-step levers timed alone on one H200 (issue 11, run Q), before either is wired in.

    python3 benchmarks/decode_levers_h200.py RESULTS.json STAGES [BASELINE_SPLIT_KV.py]

``balance``: the split-KV kernel whose chunks take a row's blocks in turn against the previous
one (contiguous chunks of the whole cache; BASELINE_SPLIT_KV.py is that file with its op renamed,
see session_q_h200.sh), at batch 1, 64 and 256 and cache fills 1/4, 3/5 and all, plus more
chunks at batch 64. ``gemv``: each llama-8b / llama-1b projection at batch 1, cuBLAS (eager
``F.linear``) against ``torch.compile`` with inductor's coordinate-descent tuning, which turns a
one-row product into a tuned Triton reduction; first call (compile) timed apart. ``autotune``:
llama-8b's q/k/v and o products at 64 and 256 rows against inductor's ``max-autotune`` GEMM
templates.
``one_row``: the same batch-1 products, cuBLAS against graphcap_cuda's one-row kernel (its
defaults and a sweep of its block shapes), each timed over enough weight copies to outgrow the
L2 cache (the ``gemv`` stage replays one matrix, so its products under ~50 MB are flattered).
Times are medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from graphcap_cuda import gemv, split_kv
from split_kv_h200 import HBM_BYTES_PER_S, LENGTH, SHAPES, inputs

#: (rows, columns) of each weight the decode step reads: joined q/k/v, o, joined gate/up,
#: down, lm_head.
PROJECTIONS = {
    "llama-8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    },
    "llama-1b": {
        "qkv": (3072, 2048),
        "o": (2048, 2048),
        "gate_up": (16384, 2048),
        "down": (2048, 8192),
        "lm_head": (128256, 2048),
    },
}


def replay_us(fn, *args) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(lambda: fn(*args))


def load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_split_kv", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def balance(baseline) -> list[dict]:
    rows = []
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for batch in (1, 64, 256):
            for fill in (0.25, 0.6, 1.0):
                written = int(LENGTH * fill)
                q, k, v, _, additive = inputs(batch, heads, kv_heads, dim, written)
                args = (q, k, v, additive, dim**-0.5, 0.0)
                new = split_kv.split_kv_decode(*args)
                old = baseline.split_kv_decode(*args)
                row = {
                    "shape": shape,
                    "batch": batch,
                    "fill": fill,
                    "max_abs_diff_vs_baseline": (new.float() - old.float()).abs().max().item(),
                    "baseline_us": replay_us(baseline.split_kv_decode, *args),
                    "balanced_us": replay_us(split_kv.split_kv_decode, *args),
                }
                if batch == 64:
                    saved = split_kv.PROGRAMS_PER_SM
                    for programs in (8, 16):
                        split_kv.PROGRAMS_PER_SM = programs
                        row[f"balanced_{programs}_per_sm_us"] = replay_us(
                            split_kv.split_kv_decode, *args
                        )
                    split_kv.PROGRAMS_PER_SM = saved
                kv_bytes = 2 * batch * kv_heads * dim * 2 * written
                row["balanced_share_of_written_bytes"] = (
                    kv_bytes / HBM_BYTES_PER_S / (row["balanced_us"] * 1e-6)
                )
                rows.append(row)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    return rows


def products(batches: tuple[int, ...], options: dict, only=None) -> list[dict]:
    rows = []
    for shape, weights in PROJECTIONS.items():
        for name, (n, k) in weights.items():
            if only is not None and (shape, name) not in only:
                continue
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
            for batch in batches:
                torch._dynamo.reset()
                x = torch.randn(batch, 1, k, device="cuda", dtype=torch.bfloat16)
                compiled = torch.compile(lambda x, w: F.linear(x, w), **options)
                start = time.perf_counter()
                out = compiled(x, w)
                torch.cuda.synchronize()
                first_s = time.perf_counter() - start
                ref = F.linear(x.double(), w.double())
                eager_us = replay_us(F.linear, x, w)
                compiled_us = replay_us(compiled, x, w)
                weight_s = n * k * 2 / HBM_BYTES_PER_S
                row = {
                    "shape": shape,
                    "product": name,
                    "rows": batch,
                    "n": n,
                    "k": k,
                    "options": options,
                    "first_call_s": first_s,
                    "cublas_us": eager_us,
                    "compiled_us": compiled_us,
                    "cublas_share": weight_s / (eager_us * 1e-6),
                    "compiled_share": weight_s / (compiled_us * 1e-6),
                    "cublas_max_abs_err": (F.linear(x, w).double() - ref).abs().max().item(),
                    "compiled_max_abs_err": (out.double() - ref).abs().max().item(),
                }
                rows.append(row)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    return rows


def rotated_us(fn, x, weights) -> float:
    """Per product, over copies of the weight that together outgrow the L2 cache (layers
    read different weights; one matrix replayed alone would be served partly from L2)."""

    def every() -> None:
        for w in weights:
            fn(x, w)

    return replay_us(every) / len(weights)


def one_row_sweep() -> list[dict]:
    """cuBLAS against graphcap_cuda.gemv at its defaults and over its block shapes."""
    rows = []
    knobs = ("MIN_BLOCK_N", "MAX_BLOCK_N", "BLOCK_K", "NUM_WARPS")
    saved = {name: getattr(gemv, name) for name in knobs}
    for shape, weights in PROJECTIONS.items():
        for name, (n, k) in weights.items():
            copies = max(1, min(32, -(-400_000_000 // (n * k * 2))))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16)
            weight_s = n * k * 2 / HBM_BYTES_PER_S
            error = (gemv.gemv(x, ws[0]).double() - F.linear(x.double(), ws[0].double())).abs()
            row = {
                "shape": shape,
                "product": name,
                "n": n,
                "k": k,
                "copies": copies,
                "cublas_us": rotated_us(F.linear, x, ws),
                "gemv_us": rotated_us(gemv.gemv, x, ws),
                "gemv_max_abs_err": error.max().item(),
                "cublas_max_abs_err": (
                    F.linear(x, ws[0]).double() - F.linear(x.double(), ws[0].double())
                )
                .abs()
                .max()
                .item(),
                "sweep": [],
            }
            for block_n in (2, 4, 8, 16, 32):
                for block_k in (128, 256, 512):
                    for warps in (4, 8):
                        setting = dict(
                            MIN_BLOCK_N=block_n,
                            MAX_BLOCK_N=block_n,
                            BLOCK_K=block_k,
                            NUM_WARPS=warps,
                        )
                        for knob, value in setting.items():
                            setattr(gemv, knob, value)
                        us = rotated_us(gemv.gemv, x, ws)
                        row["sweep"].append({**setting, "us": us})
                        for knob, value in saved.items():
                            setattr(gemv, knob, value)
            best = min(row["sweep"], key=lambda r: r["us"])
            row["best"] = best
            row["cublas_share"] = weight_s / (row["cublas_us"] * 1e-6)
            row["gemv_share"] = weight_s / (row["gemv_us"] * 1e-6)
            row["best_share"] = weight_s / (best["us"] * 1e-6)
            rows.append(row)
            print(
                {
                    k: round(v, 3) if isinstance(v, float) else v
                    for k, v in row.items()
                    if k != "sweep"
                }
            )
            del ws
    return rows


def main() -> int:
    out = Path(sys.argv[1])
    stages = sys.argv[2].split(",")
    report = {
        "command": " ".join(["python3", *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    if "balance" in stages:
        report["balance"] = balance(load(sys.argv[3]))
        out.write_text(json.dumps(report, indent=1))
    if "gemv" in stages:
        report["gemv"] = products((1,), {"options": {"coordinate_descent_tuning": True}})
        out.write_text(json.dumps(report, indent=1))
    if "one_row" in stages:
        report["one_row"] = one_row_sweep()
        out.write_text(json.dumps(report, indent=1))
    if "autotune" in stages:
        only = {("llama-8b", "qkv"), ("llama-8b", "o")}  # the products cuBLAS reads slowest
        report["autotune"] = products((64, 256), {"mode": "max-autotune-no-cudagraphs"}, only)
        out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
