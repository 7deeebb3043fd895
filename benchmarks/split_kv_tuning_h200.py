"""Launch settings of the split-KV decode kernel on one H200 (issue 11, runs N and AA): which
span scan, pipeline depth, block and warp count, and split policy read the written K/V fastest.

    python3 benchmarks/split_kv_tuning_h200.py RESULTS.json [STAGE,...]

Same shapes and timing as ``split_kv_h200.py`` (CUDA-graph replays, 640-column cache, three
fifths written); SDPA with ``enable_gqa`` is timed alongside as the baseline. Stages:
``default``; ``scan`` (the span scan in blocks of columns, as before, against one wide read of
the mask); ``pipeline`` (num_stages x num_warps x block size at batch 64 and 256); ``small``
(the split count at batch 1: one program per row and K/V head, ``direct``, against more chunks
and a combine); ``splits`` (run AA: programs per multiprocessor, which set the split count, x
block size, at batch 64 and 256 and three fills); ``warps`` (run AA: pipeline depth x warps
with the defaults that came of it). Runs N and AA swept blocks in columns (``BLOCK_N``, at
their commits; AA's ``splits`` on 0dacdb1 with 32 and 64 columns); the kernel now sizes them
in bytes. Run AA's first call also timed K/V loads bounded by the open span alone against the
kernel's loads masked by each column's entry (stage ``loads`` on commit b378ae1, knob
``SPAN_LOADS``): slower in every case, not kept.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from graphcap_cuda import split_kv
from split_kv_h200 import HBM_BYTES_PER_S, LENGTH, SHAPES, inputs
from triton.runtime.errors import OutOfResources

FILL = 0.6
KNOBS = (
    "BLOCK_BYTES",
    "BLOCK_N_FEW_ROWS",
    "NUM_WARPS",
    "NUM_STAGES",
    "PROGRAMS_PER_SM",
    "MAX_SCAN",
)


def replay_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn)


def time_case(shape: str, batch: int, sdpa: bool = False, fill: float = FILL) -> dict:
    heads, kv_heads, dim = SHAPES[shape]
    written = int(LENGTH * fill)
    q, k, v, _, additive = inputs(batch, heads, kv_heads, dim, written)
    us = replay_us(lambda: split_kv.split_kv_decode(q, k, v, additive, dim**-0.5, 0.0))
    row = {"shape": shape, "batch": batch, "fill": fill, "split_kv_us": us}
    row["share_of_written_bytes"] = (
        2 * batch * kv_heads * dim * 2 * written / HBM_BYTES_PER_S / (us * 1e-6)
    )
    if sdpa:
        row["sdpa_gqa_us"] = replay_us(
            lambda: F.scaled_dot_product_attention(
                q[:, :, None], k, v, attn_mask=additive[:, None, None], enable_gqa=True
            )
        )
    return row


def with_knobs(knobs: dict, cases, fill: float = FILL) -> list[dict]:
    saved = {name: getattr(split_kv, name) for name in KNOBS}
    stage = knobs.pop("_stage")
    try:
        for name, value in knobs.items():
            setattr(split_kv, name, value)
        rows = []
        for shape, batch in cases:
            try:
                timed = time_case(shape, batch, fill=fill)
            except OutOfResources as exc:  # e.g. 256-column blocks: too much shared memory
                timed = {"shape": shape, "batch": batch, "error": str(exc)}
            row = {"stage": stage, **timed, **knobs}
            rows.append(row)
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
        return rows
    finally:
        for name, value in saved.items():
            setattr(split_kv, name, value)


def main() -> int:
    out = Path(sys.argv[1])
    stages = (sys.argv[2] if len(sys.argv) > 2 else "default,scan,pipeline,small").split(",")
    report = {
        "command": " ".join(["python3", *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "defaults": {name: getattr(split_kv, name) for name in KNOBS},
        "rows": [],
    }
    rows = report["rows"]
    everything = [(s, b) for s in SHAPES for b in (1, 64, 256)]
    large = [(s, b) for s in SHAPES for b in (64, 256)]
    small = [(s, 1) for s in SHAPES]
    if "default" in stages:
        for shape, batch in everything:  # the defaults, with SDPA alongside
            rows.append({"stage": "default", **time_case(shape, batch, sdpa=True)})
            print(rows[-1])
        out.write_text(json.dumps(report, indent=1))
    if "scan" in stages:
        for scan in (64, 128, 1024):  # 64/128: blockwise as before (BLOCK_N 64; 128 at batch 1)
            rows += with_knobs({"MAX_SCAN": scan, "_stage": "scan"}, everything)
        out.write_text(json.dumps(report, indent=1))
    if "pipeline" in stages:
        for num_stages in (1, 2, 3, 4):
            for warps in (4, 8):
                for block_bytes in (4096, 8192, 16384):
                    knobs = {
                        "NUM_STAGES": num_stages,
                        "NUM_WARPS": warps,
                        "BLOCK_BYTES": block_bytes,
                    }
                    rows += with_knobs({**knobs, "_stage": "pipeline"}, large)
            out.write_text(json.dumps(report, indent=1))
    if "small" in stages:
        for programs in (0, 1, 2, 4, 8):  # 0: one chunk per row and K/V head (no combine)
            for block_n in (64, 128, 256):
                for warps in (2, 4, 8):
                    knobs = {"PROGRAMS_PER_SM": programs, "BLOCK_N_FEW_ROWS": block_n}
                    rows += with_knobs({**knobs, "NUM_WARPS": warps, "_stage": "small"}, small)
        out.write_text(json.dumps(report, indent=1))
    if "splits" in stages:
        for fill in (0.3, 0.6, 1.0):
            for programs in (1, 2, 4):
                for block_bytes in (8192, 16384):
                    knobs = {"PROGRAMS_PER_SM": programs, "BLOCK_BYTES": block_bytes}
                    rows += with_knobs({**knobs, "_stage": "splits"}, large, fill)
        out.write_text(json.dumps(report, indent=1))
    if "warps" in stages:
        for num_stages in (2, 3, 4, 5):
            for warps in (2, 4, 8):
                knobs = {"NUM_STAGES": num_stages, "NUM_WARPS": warps, "_stage": "warps"}
                rows += with_knobs(knobs, large)
        out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
