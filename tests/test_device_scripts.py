"""The scripts a device session runs (benchmarks/h200.sh's parts) still run: each in its CPU
mode, in a fresh process, so one that rots is found on the commit that broke it, not in the
minutes of device time a session gets."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from script_runs import run_on_cpu

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return run_on_cpu(BENCHMARKS / name, *args, env={"TRITON_INTERPRET": "1"})


def test_sharded_check_passes_at_one_rank(tmp_path):
    out = tmp_path / "sharded.json"
    run_script("sharded_check.py", str(out))
    result = json.loads(out.read_text())
    assert result["zero3"]["passed"] and result["fsdp2"]["passed"], result


@pytest.mark.parametrize(
    "script", ["trainer_exact_h200.py", "sampler_h200.py", "exact_kernels_h200.py"]
)
def test_smoke_runs_write_their_report(tmp_path, script):
    out = tmp_path / "out.json"
    run_script(script, str(out), "--smoke")
    report = json.loads(out.read_text())
    assert report and not report.get("errors"), report.get("errors")


def test_the_sampler_benchmark_registers_the_shared_generator_with_its_capture(monkeypatch):
    """A capture knows only the default generator: the shared-generator case's draw from its
    own generator failed inside ``time_calls``' capture on the GPU until the case handed it
    over to be registered (as the engine registers a call's generator)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import sampler_h200

    seen = []

    def time_calls(calls, smoke, generators=()):
        seen.append(list(generators))
        for call in calls:
            call()
        return {}

    scores = sampler_h200._scores(2, 300, torch.device("cpu"))
    for draws in ("per_row", "generate"):
        sampler_h200._case(scores, "topp95", {"top_p": 0.95}, None, time_calls, True, draws=draws)
    assert seen[0] == []
    assert len(seen[1]) == 1 and isinstance(seen[1][0], torch.Generator)
