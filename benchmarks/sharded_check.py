"""Sharded trainers on one device, one rank: the scenarios of tests/test_sharded_trainers.py
(ZeRO-3's gather for generation, played as DeepSpeed does it, and FSDP2's ``fully_shard``) on
the selected backend with its own communication backend (NCCL on CUDA), a process group of one.

Each scenario runs 4 rounds through the drop-in with a real training step between them and
checks what the CPU test checks at two gloo ranks: every round is served from the first
round's graphs (no capture after it), tokens equal a never-sharded twin's bit for bit, one
weight copy per round, nothing held while the trainer trains, and FSDP2's parameters sharded
again after each round. (At one rank FSDP2 unshards by a copy, no collective, so the CPU
test's count of all-gathers has nothing to count here.)

GRAPHCAP_BACKEND=cuda python benchmarks/sharded_check.py [OUT.json]
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import graphcap

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_sharded_trainers import ROUNDS, check_served_from_the_first_rounds_graphs, fsdp2, zero3


def summary(record: dict) -> dict:
    """What a record says, without its token tensors."""
    rounds = [{k: v for k, v in r.items() if k != "tokens"} for r in record.get("rounds", [])]
    return {**{k: v for k, v in record.items() if k != "rounds"}, "rounds": rounds}


def main() -> None:
    backend = graphcap.get_backend()
    init = Path(tempfile.mkdtemp()) / "init"
    if backend.device.type != "cpu":
        backend.device_module.set_device(backend.device)
    dist.init_process_group(
        backend.communication_backend_name(),
        init_method=f"file://{init}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )
    results = {"backend": backend.name, "device": backend.device_name(), "rounds": ROUNDS}
    try:
        for name, scenario in (("zero3", zero3), ("fsdp2", fsdp2)):
            try:
                record = scenario(0, backend)
                check_served_from_the_first_rounds_graphs(record)
                if name == "fsdp2":  # (one rank gathers with no collective: nothing to count)
                    assert all(record["sharded_after"]), record["sharded_after"]
                results[name] = {"passed": True, **summary(record)}
            except Exception as exc:  # one scenario's failure keeps the other's result
                traceback.print_exc()
                results[name] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
            print(name, json.dumps(results[name], default=str), flush=True)
    finally:
        dist.destroy_process_group()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(results, indent=1, default=str))
    sys.exit(0 if all(results[n]["passed"] for n in ("zero3", "fsdp2")) else 1)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
