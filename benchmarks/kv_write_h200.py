"""One layer's decode K/V write on one H200 (issue 11, run O): two ``scatter_`` (the eager
write before run O), two ``index_put_`` (graphcap's ``put_columns`` run eagerly) and
``torch.compile(put_columns)`` (one kernel, what ``compile=True`` captures), timed as
CUDA-graph replays at llama-8b's K/V shape (8 heads x 128) in bf16, 640-column cache. One JSON.

    python3 benchmarks/kv_write_h200.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton

from graphcap.rollout.cache import put_columns

HEADS, DIM, LENGTH = 8, 128, 640


def scatter_both(keys, values, index, k, v):
    columns = index[2][..., None].expand(*k.shape[:3], DIM)
    keys.scatter_(2, columns, k)
    values.scatter_(2, columns, v)


def main() -> int:
    compiled = torch.compile(put_columns)
    rows = []
    for batch in (1, 64, 256):
        keys, values = (
            torch.zeros(batch, HEADS, LENGTH, DIM, device="cuda", dtype=torch.bfloat16)
            for _ in range(2)
        )
        k, v = (
            torch.randn(batch, HEADS, 1, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)
        )
        index = (
            torch.arange(batch, device="cuda").view(batch, 1, 1),
            torch.arange(HEADS, device="cuda").view(1, HEADS, 1),
            torch.randint(0, LENGTH, (batch, 1, 1), device="cuda"),
        )
        row = {"batch": batch}
        args = (keys, values, index, k, v)
        for name, fn in (
            ("scatter", scatter_both),
            ("index_put", put_columns),
            ("compiled", compiled),
        ):
            fn(*args)  # compile outside the graph
            row[f"{name}_us"] = 1e3 * triton.testing.do_bench_cudagraph(
                lambda fn=fn, args=args: fn(*args)
            )
        rows.append(row)
        print(row, flush=True)
    report = {"command": " ".join(["python3", *sys.argv]), "device": torch.cuda.get_device_name()}
    Path(sys.argv[1]).write_text(json.dumps({**report, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
