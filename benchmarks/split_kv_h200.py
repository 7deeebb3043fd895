"""The split-KV decode kernel alone on one H200 (issue 11): bf16 accuracy against a float64
reference, and its time against SDPA with ``enable_gqa`` (the kernel it replaces) at RL batch
sizes and cache fills, as a share of the bandwidth of the K/V bytes each must read; then a small
sweep of its launch settings. One JSON.

    python3 benchmarks/split_kv_h200.py RESULTS.json

Shapes: llama-8b / llama-1b attention (32 query heads, 8 K/V heads, head_dim 128 / 64), a
640-column cache (128 prompt + 512 new tokens), 1/4, 3/5 and all of it written. Times are
medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``), as the engine runs them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from graphcap_cuda import split_kv

HBM_BYTES_PER_S = 4.8e12
LENGTH = 640
SHAPES = {"llama-8b": (32, 8, 128), "llama-1b": (32, 8, 64)}


def inputs(batch, heads, kv_heads, dim, written, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, kv_heads, LENGTH, dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, kv_heads, LENGTH, dim, device="cuda", dtype=dtype, generator=gen)
    columns = torch.arange(LENGTH, device="cuda")
    pads = torch.randint(0, 32, (batch, 1), device="cuda", generator=gen)
    valid = (columns[None] < written) & (columns[None] >= pads)
    additive = torch.where(valid, 0.0, torch.finfo(dtype).min).to(dtype)
    return q, k, v, valid, additive


def accuracy() -> list[dict]:
    rows = []
    for name, (heads, kv_heads, dim) in SHAPES.items():
        for batch, written in ((1, 200), (64, 384), (256, 640)):
            q, k, v, valid, additive = inputs(batch, heads, kv_heads, dim, written, seed=batch)
            ref = F.scaled_dot_product_attention(
                q[:, :, None].double(),
                k.double(),
                v.double(),
                attn_mask=valid[:, None, None],
                enable_gqa=True,
            )[:, :, 0]
            out = split_kv.split_kv_decode(q, k, v, additive, dim**-0.5, 0.0).double()
            sdpa = F.scaled_dot_product_attention(
                q[:, :, None], k, v, attn_mask=additive[:, None, None], enable_gqa=True
            )[:, :, 0].double()
            rows.append(
                {
                    "shape": name,
                    "batch": batch,
                    "written": written,
                    "split_kv_rel_err": float((out - ref).norm() / ref.norm()),
                    "sdpa_bf16_rel_err": float((sdpa - ref).norm() / ref.norm()),
                    "finite": bool(torch.isfinite(out).all()),
                }
            )
            print(rows[-1], flush=True)
    return rows


def timing(settings: dict | None = None, fills=(0.25, 0.6, 1.0), batches=(1, 64, 256)) -> list:
    rows = []
    for name, (heads, kv_heads, dim) in SHAPES.items():
        for batch in batches:
            for fill in fills:
                row = {"shape": name, "batch": batch, "fill": fill}
                row.update(time_one(batch, heads, kv_heads, dim, int(LENGTH * fill), settings))
                rows.append(row)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    return rows


def time_one(batch, heads, kv_heads, dim, written, settings) -> dict:
    """The kernel's replay time; with default settings also SDPA's and the bandwidth shares."""
    q, k, v, _, additive = inputs(batch, heads, kv_heads, dim, written)
    scale = dim**-0.5
    kernel_s = 1e-3 * triton.testing.do_bench_cudagraph(
        lambda: split_kv.split_kv_decode(q, k, v, additive, scale, 0.0)
    )
    if settings is not None:
        return {"split_kv_us": kernel_s * 1e6, **settings}
    sdpa_s = 1e-3 * triton.testing.do_bench_cudagraph(
        lambda: F.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=additive[:, None, None], enable_gqa=True
        )
    )
    per_column = 2 * batch * kv_heads * dim * 2  # K and V bytes of one cache column
    return {
        "split_kv_us": kernel_s * 1e6,
        "sdpa_gqa_us": sdpa_s * 1e6,
        "split_kv_share_of_written_bytes": per_column * written / HBM_BYTES_PER_S / kernel_s,
        "sdpa_share_of_whole_cache_bytes": per_column * LENGTH / HBM_BYTES_PER_S / sdpa_s,
        "speedup": sdpa_s / kernel_s,
    }


def sweep() -> list[dict]:
    rows = []
    default = (split_kv.BLOCK_N, split_kv.NUM_WARPS, split_kv.PROGRAMS_PER_SM)
    for block_n in (64, 128):
        for warps in (2, 4, 8):
            for programs in (1, 2, 4):
                split_kv.BLOCK_N, split_kv.NUM_WARPS, split_kv.PROGRAMS_PER_SM = (
                    block_n,
                    warps,
                    programs,
                )
                settings = {"block_n": block_n, "num_warps": warps, "programs_per_sm": programs}
                rows += timing(settings, fills=(0.6,))
    split_kv.BLOCK_N, split_kv.NUM_WARPS, split_kv.PROGRAMS_PER_SM = default
    return rows


def main() -> int:
    out = Path(sys.argv[1])
    report = {
        "command": " ".join(["python3", *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "defaults": {
            "block_n": split_kv.BLOCK_N,
            "num_warps": split_kv.NUM_WARPS,
            "programs_per_sm": split_kv.PROGRAMS_PER_SM,
        },
    }
    report["accuracy_bf16"] = accuracy()
    report["timing"] = timing()
    out.write_text(json.dumps(report, indent=1))
    report["sweep"] = sweep()
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
