"""TRL's GRPOTrainer with graphcap under the policy's ``generate``: a real trainer run.

``examples/trl_grpo.py --compare`` runs, as written, on the CPU reference backend: three
optimizer steps of a tiny random-weight Llama on an in-memory prompt set with a rule-based
reward, TRL sampling with its fixed seed, once without graphcap and once with it. The run with
graphcap must produce exactly the completions of the run without it, step by step, from graph
replays of one capture. Skipped where ``trl`` is not installed (the cpu tox environment has it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_runs import run_on_cpu

pytest.importorskip("trl")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo.py"
STEPS = 3


def test_grpo_with_graphcap_samples_exactly_what_it_samples_without(tmp_path):
    report = tmp_path / "runs.json"
    args = ("--compare", "--draws", "generate", "--steps", str(STEPS))
    args += ("--output-dir", str(tmp_path), "--json", str(report))
    done = run_on_cpu(EXAMPLE, *args, timeout=600)
    assert "completions equal to the plain run's: 100.0% of tokens" in done.stdout
    plain, accelerated = json.loads(report.read_text())["runs"]
    assert len(plain["completions"]) == STEPS and accelerated["completions"] == plain["completions"]
    assert accelerated["served"] == STEPS and not accelerated["fallbacks"]
    assert accelerated["path"] == "static_graph" and accelerated["replays"] > 0
    assert accelerated["captures"] == 1  # the prompts' varying widths share one length bucket
    tokens = {t for step in plain["completions"] for row in step for t in row}
    assert len(tokens) > 3  # not a degenerate model repeating one token
