"""The split-KV kernel's launch at a few rows (issue 11, run AD): where rows x K/V heads do not
fill the H200, the committed rule splits each row into chunks of 128-column blocks, and run
AD's first call found the kernel slower than SDPA with ``enable_gqa`` at 4-32 rows and on long
caches. This times the kernel alone (CUDA-graph replays) for every block width and split count
at each case, against SDPA and against the committed rule's choice.

    python3 benchmarks/split_kv_few_rows_h200.py OUT.json

``split_kv.launch_shape`` is replaced per launch to force a (columns per block, chunks) pair;
the committed rule's pair is recorded too. llama-8b / llama-1b attention shapes, bf16, additive
mask, as attention_crossover_h200.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn.functional as F
import triton
from attention_crossover_h200 import case_inputs, write_report
from graphcap_cuda import split_kv

SHAPES = {"llama-8b": (32, 8, 128), "llama-1b": (32, 8, 64)}
BATCHES = (1, 2, 4, 8, 16, 32)
CASES = ((640, 0.6), (640, 1.0), (2176, 0.6))  # (cache columns, written share)
BLOCKS = (32, 64, 128)
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
REP_MS = 10  # do_bench_cudagraph's replay window per timing


def time_case(committed, name, heads, kv_heads, dim, length, fill, batch) -> dict:
    q, k, v, mask = case_inputs(batch, heads, kv_heads, dim, length, fill)
    scale = dim**-0.5

    def kernel():
        return split_kv.split_kv_decode(q, k, v, mask, scale, 0.0)

    def sdpa():
        return F.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=mask[:, None, None], enable_gqa=True
        )

    block_n, wanted = committed(batch, kv_heads, length, q.device, max(16, dim) * 2)
    split_kv.launch_shape = committed
    now_us = 1e3 * triton.testing.do_bench_cudagraph(kernel, rep=REP_MS)
    sdpa_us = 1e3 * triton.testing.do_bench_cudagraph(sdpa, rep=REP_MS)
    times = {}
    for block in BLOCKS:
        for splits in sorted({split_kv.chunking(length, block, w)[1] for w in SPLITS}):
            split_kv.launch_shape = lambda *a, b=block, s=splits: (b, s)
            times[f"{block}x{splits}"] = 1e3 * triton.testing.do_bench_cudagraph(kernel, rep=REP_MS)
    split_kv.launch_shape = committed
    best = min(times, key=times.get)
    row = {
        "shape": name,
        "batch": batch,
        "length": length,
        "fill": fill,
        "sdpa_us": sdpa_us,
        "committed": f"{block_n}x{split_kv.chunking(length, block_n, wanted)[1]}",
        "committed_us": now_us,
        "best": best,
        "best_us": times[best],
        "times_us": times,
    }
    print(
        f"{name} L={length} fill={fill} bs={batch}: sdpa {sdpa_us:.1f} "
        f"committed {row['committed']} {now_us:.1f} best {best} {times[best]:.1f}",
        flush=True,
    )
    return row


def main() -> int:
    out = Path(sys.argv[1])
    committed = split_kv.launch_shape
    rows = []
    for name, (heads, kv_heads, dim) in SHAPES.items():
        for length, fill in CASES:
            for batch in BATCHES:
                rows.append(time_case(committed, name, heads, kv_heads, dim, length, fill, batch))
                write_report(out, rows)  # each case as it ends: a call cut short keeps them
    return 0


if __name__ == "__main__":
    sys.exit(main())
