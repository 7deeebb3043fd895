"""Where the split-KV kernel starts to pay over SDPA with ``enable_gqa`` (issue 11): both alone,
CUDA-graph replays (``triton.testing.do_bench_cudagraph``), at small batch sizes, two cache
lengths and three fills, llama-8b / llama-1b attention shapes, bf16, the engine's additive mask.

    python3 benchmarks/attention_crossover_h200.py OUT.json

SDPA reads the whole static cache, the kernel only the written columns; at a few rows both are
bound by latency, not bytes. Each row of OUT.json gives both times, the ratio and the K/V bytes
of the whole cache per layer (what SDPA reads).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from graphcap_cuda import split_kv

SHAPES = {"llama-8b": (32, 8, 128), "llama-1b": (32, 8, 64)}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CASES = ((640, 0.25), (640, 0.6), (640, 1.0), (2176, 0.6))  # (cache columns, written share)


def case_inputs(batch: int, heads: int, kv_heads: int, dim: int, length: int, fill: float):
    """bf16 query, K, V and the engine's additive mask: ``fill`` of the cache written, up to 31
    columns of left padding a row."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    dtype = torch.bfloat16
    q = torch.randn(batch, heads, dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, kv_heads, length, dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    columns = torch.arange(length, device="cuda")
    pads = torch.randint(0, 32, (batch, 1), device="cuda", generator=gen)
    valid = (columns[None] < int(length * fill)) & (columns[None] >= pads)
    mask = torch.where(valid, 0.0, torch.finfo(dtype).min).to(dtype)
    return q, k, v, mask


def write_report(out: Path, rows: list[dict]) -> None:
    report = {
        "command": " ".join(["python3", *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=1))


def time_pair(batch: int, heads: int, kv_heads: int, dim: int, length: int, fill: float) -> dict:
    q, k, v, mask = case_inputs(batch, heads, kv_heads, dim, length, fill)
    scale = dim**-0.5
    kernel_ms = triton.testing.do_bench_cudagraph(
        lambda: split_kv.split_kv_decode(q, k, v, mask, scale, 0.0)
    )
    sdpa_ms = triton.testing.do_bench_cudagraph(
        lambda: F.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=mask[:, None, None], scale=scale, enable_gqa=True
        )
    )
    return {
        "split_kv_us": kernel_ms * 1e3,
        "sdpa_gqa_us": sdpa_ms * 1e3,
        "split_kv_speedup": sdpa_ms / kernel_ms,
        "cache_kv_bytes_per_layer": 2 * batch * kv_heads * length * dim * 2,
    }


def main() -> int:
    out = Path(sys.argv[1])
    rows = []
    for name, (heads, kv_heads, dim) in SHAPES.items():
        for length, fill in CASES:
            for batch in BATCHES:
                row = {"shape": name, "batch": batch, "length": length, "fill": fill}
                row.update(time_pair(batch, heads, kv_heads, dim, length, fill))
                rows.append(row)
                print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    write_report(out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
