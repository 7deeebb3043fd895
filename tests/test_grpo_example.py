"""examples/grpo_loop.py runs: rollouts, in-place policy-gradient steps, the captures it promises.

The example asserts its own capture count and that no weight moved, so a non-zero exit code is
the failure; the printed ``captures=`` line and the log-prob agreement are checked here too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from graphcap.registry import ENV_VAR

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_loop.py"


def run_example(*args: str, backend: str = "cpu") -> subprocess.CompletedProcess:
    env = {**os.environ, ENV_VAR: backend}
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env, timeout=300
    )


def printed_captures(stdout: str) -> int:
    """The example's capture count, checked against the one it expected (one graph per batch
    size the live-row ladder reached, kept across the in-place updates)."""
    match = re.search(r"^captures=(\d+) \(expected (\d+)\): batch sizes \[(.*)\]", stdout, re.M)
    assert match, f"no captures= line in:\n{stdout}"
    assert match.group(1) == match.group(2), match.group(0)
    # the graphs each rollout says it captured add up to the run's count
    captured = re.findall(r"captured (\d+) graph\(s\)", stdout)
    assert sum(map(int, captured)) == int(match.group(1)), stdout
    return int(match.group(1))


def test_grpo_example_runs_as_a_script_and_keeps_its_graphs():
    done = run_example("--iterations", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert printed_captures(done.stdout) >= 1
    assert done.stdout.count("path static_graph") == 3 and "woke" not in done.stdout


def test_grpo_example_with_sleep_keeps_its_graphs(capsys: pytest.CaptureFixture[str]):
    spec = importlib.util.spec_from_file_location("grpo_loop", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    summary = example.main(["--iterations", "3", "--sleep", "--max-new-tokens", "8"])
    # the CPU reference backend keeps addresses across a sleep: each ladder size once, and every
    # rollout after a sleep says it woke
    out = capsys.readouterr().out
    assert printed_captures(out) == summary["captures"] and out.count("woke in") == 2
    assert summary["captures"] >= 1 and summary["path"] == "static_graph"
    assert summary["max_logprob_diff"] < 1e-4  # fp32: rollout == trainer's recomputation


@pytest.mark.device
def test_grpo_example_runs_unchanged_on_the_device(requested_backend):
    if not requested_backend or requested_backend == "cpu":
        pytest.skip("set GRAPHCAP_BACKEND=cuda (or npu) to run the example on a device")
    done = run_example("--iterations", "3", backend=requested_backend)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"backend {requested_backend}" in done.stdout
    assert printed_captures(done.stdout) >= 1
