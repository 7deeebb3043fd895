"""The split-KV kernel's persistent form against one program a row and K/V head, timed alone on
one H200 (issue 11, run AC).

    python3 benchmarks/split_kv_persistent_h200.py RESULTS.json

Run AA's timings of the one-chunk kernel (``aa2-splits/``) fit a fixed 12.5 µs a launch at
llama-8b batch 256 (2,048 rows x K/V heads, in waves of programs) and 0.4 µs at batch 64 (all
resident at once). Here: batch 128 and 256 of both llama shapes, three fills of the 640-column
cache (left padding of 0-31 columns a row), ``PERSISTENT_PER_SM`` 0 (off), 2, 4 and 8, each
timed in CUDA-graph replays; bytes are the K/V of open columns, and each output is compared
with the kernel's without the persistent form (the same blocks in the same order: 0 expected).
It ran on commit 0c79900 (``ac-persist/``): the form was slower in every batch-256 case and
was removed, with ``PERSISTENT_PER_SM``; check that commit out to run it again.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import triton
from graphcap_cuda import split_kv
from split_kv_h200 import HBM_BYTES_PER_S, LENGTH, SHAPES, inputs

FILLS = (0.3, 0.6, 1.0)
SETTINGS = (0, 2, 4, 8)


def main(path: str) -> None:
    rows = []
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for batch in (128, 256):
            for fill in FILLS:
                q, k, v, valid, additive = inputs(batch, heads, kv_heads, dim, int(LENGTH * fill))
                moved = 2 * int(valid.sum()) * kv_heads * dim * q.element_size()
                call = functools.partial(
                    split_kv.split_kv_decode, q, k, v, additive, dim**-0.5, 0.0
                )
                baseline = None
                for setting in SETTINGS:
                    split_kv.PERSISTENT_PER_SM = setting
                    out = call()
                    baseline = out if baseline is None else baseline
                    us = 1e3 * triton.testing.do_bench_cudagraph(call)
                    row = {
                        "shape": shape,
                        "batch": batch,
                        "fill": fill,
                        "persistent_per_sm": setting,
                        "split_kv_us": us,
                        "share_of_open_bytes": moved / HBM_BYTES_PER_S / (us * 1e-6),
                        "max_abs_diff_vs_off": (out.float() - baseline.float()).abs().max().item(),
                    }
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    Path(path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
