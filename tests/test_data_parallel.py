"""Data-parallel rollouts: the torchrun example on 2 CPU processes equals one process."""

from __future__ import annotations

import importlib.util
import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphcap.cpu import CPUBackend
from graphcap.preset_models import build_model
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.data_parallel import (
    generate_data_parallel,
    rank_sampling,
    rank_seed,
    shard_bounds,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "data_parallel_rollout.py"
ROWS, WIDTH, NEW = 7, 8, 10  # 7 rows over 2 ranks: shares of 4 and 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _example():
    spec = importlib.util.spec_from_file_location("data_parallel_rollout", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shards_are_contiguous_balanced_and_cover_every_row():
    for rows in range(0, 9):
        for world in (1, 2, 3, 4):
            bounds = [shard_bounds(rows, rank, world) for rank in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == rows
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            sizes = [stop - start for start, stop in bounds]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert rank_seed(7, 0) == 7 and rank_seed(7, 3) == 10
    call = SamplingParams(do_sample=True, seed=7)
    assert rank_sampling(call, 3).seed == 10 and rank_sampling(None, 3) is None
    vllm = SamplingParams.from_vllm(temperature=1.0, seed=7)  # a request's seed is its own
    assert rank_sampling(vllm, 3) is vllm
    with pytest.raises(ValueError, match="rank must be in"):
        shard_bounds(4, 2, 2)


def test_without_a_distributed_job_the_error_says_what_to_do():
    engine = RolloutEngine(torch.nn.Linear(1, 1), RolloutConfig(backend=CPUBackend()))
    with pytest.raises(ValueError, match="torchrun"):
        generate_data_parallel(engine, torch.zeros(1, 1, dtype=torch.long))


def test_torchrun_example_on_two_cpu_ranks_equals_one_process(tmp_path):
    out = tmp_path / "rows.pt"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        str(EXAMPLE),
        *("--prompts", str(ROWS), "--prompt-len", str(WIDTH), "--max-new-tokens", str(NEW)),
        *("--out", str(out)),
    ]
    env = {**os.environ, "GRAPHCAP_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    gathered = torch.load(out)
    assert gathered["report"]["paths"] == ["static_graph", "static_graph"]

    example = _example()
    ids, mask = example.make_prompts(ROWS, WIDTH, 8192)
    model = build_model("tiny-llama", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    engine = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=CPUBackend()))
    alone = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW))
    assert torch.equal(gathered["sequences"], alone.sequences)
