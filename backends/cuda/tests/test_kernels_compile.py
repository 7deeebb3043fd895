"""Every launch graphcap_cuda's host functions make compiles for a Hopper GPU through Triton's
own code generator, on a machine without one (``compile_check.py``, in a process without the
interpreter). The CPU interpreter runs Python the code generator refuses: a norm read in one
load once passed every interpreted test and failed to compile on the H200. The compiled
kernels' shared memory must also fit the H200 (an overflow once showed only on the GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the kernels need Triton (CUDA builds of torch ship it)")

from compile_check import SAMPLER_KERNELS, SHARED_LIMIT


def test_every_launch_compiles_for_hopper_and_fits_its_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_check.py")
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in run.stdout.splitlines()]
    dependent = {"_gemv", "_split_kv_partial", *SAMPLER_KERNELS}
    exact = {"_linear", "_ordered_attention", "_rms_norm", "_softmax_chunks", "_softmax_write"}
    exact |= {"_rotary", "_silu_mul"}  # launched plainly
    assert {r["kernel"] for r in records} == dependent | exact
    assert len(records) >= 40  # every form of both kernels, not one
    normed = [r["constexprs"] for r in records if r["constexprs"].get("NORM")]
    assert {c["NORM_ROW"] > 0 for c in normed} == {True, False}  # one load and block by block
    assert all(r["constexprs"]["PDL"] for r in records if r["kernel"] in dependent)  # its code too
    paged = {r["constexprs"]["PAGED"] for r in records if r["kernel"] == "_split_kv_partial"}
    assert paged == {True, False}  # contiguous K/V and pools read through a block table
    tiles = {r["constexprs"]["BLOCK_M"] for r in records if r["kernel"] == "_linear"}
    assert tiles == {64, 128}  # a decode step's tile and a trainer's
    failed = [r for r in records if "error" in r]
    assert not failed, json.dumps(failed[:2], indent=1)
    assert max(r["shared"] for r in records) <= SHARED_LIMIT
