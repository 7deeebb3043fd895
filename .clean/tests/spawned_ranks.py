"""Scenarios run on two gloo ranks in spawned processes, each rank's records brought back.

A test module defines ``SCENARIOS`` (name -> ``scenario(rank, *extra)`` returning a picklable
record) and, optionally, ``prepare(rank, out_dir)`` returning ``extra`` (built after the process
group exists, e.g. a tensor-parallel model). One spawn runs every scenario; a scenario that
raises is recorded as an error and fails only its own tests.
"""

from __future__ import annotations

import datetime
import importlib
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _worker(rank: int, module: str, out_dir: str, timeout_s: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'init')}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    tests = importlib.import_module(module)
    records = {}
    try:
        extra = tests.prepare(rank, out_dir) if hasattr(tests, "prepare") else ()
        for name, scenario in tests.SCENARIOS.items():
            try:
                records[name] = scenario(rank, *extra)
            except Exception as exc:  # kept, so the other scenarios' tests still report
                records[name] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        torch.save(records, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def spawn_ranks(module: str, out_dir: Path, deadline_s: int, timeout_s: int) -> list[dict]:
    """Every rank's records of ``module``'s scenarios; fails the test past ``deadline_s``."""
    context = mp.start_processes(
        _worker,
        args=(module, str(out_dir), timeout_s),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the two ranks did not finish within {deadline_s} s (diverged?)")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def records(ranks: list[dict], scenario: str) -> list[dict]:
    """Both ranks' records of one scenario; a scenario that raised fails its test here."""
    found = [r.get(scenario, {"error": "not run (preparing the ranks failed?)"}) for r in ranks]
    for rank, rec in enumerate(found):
        assert "error" not in rec, f"rank {rank}: {rec.get('error')}"
    return found
