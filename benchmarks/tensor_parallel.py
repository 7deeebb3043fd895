"""Tensor-parallel rollouts on transformers' own TP: graph == eager, step time, recapture.

    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py OUT.json [--model llama-1b]

Rank 0 saves the preset (seeded random weights) with save_pretrained; every rank loads it with
``DistributedConfig(tp_size=WORLD, tp_plan="auto")`` and runs, with
``RolloutConfig(process_group=WORLD, compile=False)`` (uncompiled, so that fp32 graph steps must
equal eager ones bit for bit):

1. graph vs eager on the shard (greedy, no EOS): tokens equal on each rank and across ranks
   (exact in fp32: ``--dtype fp32``; in bf16 the graph's attention kernel may round differently);
2. decode step time of the static graph, tensor-parallel, and on rank 0 alone with the whole
   model on one device (same batch and lengths);
3. recapture agreement: a second call changes the pad id on rank 1 only; both ranks recapture
   (rank 0 with "another rank recaptures") and replay the same tokens.

Rank 0 writes OUT.json. docs/distributed.md explains the setup; ``bash benchmarks/h200.sh OUT
distributed`` runs this on two GPUs with the data-parallel example.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.distributed import DistributedConfig

from graphcap import get_backend
from graphcap.preset_models import DTYPES, build_model, default_dtype_name
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams


def prompts(rows: int, width: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, width), generator=gen)
    return ids.to(device), torch.ones_like(ids).to(device)


def timed(engine: RolloutEngine, ids, mask, params: SamplingParams, repeats: int) -> dict:
    """The first call (captures) and the median decode step of ``repeats`` more calls."""
    first = engine.generate(ids, mask, params)
    steps = []
    for _ in range(repeats):
        result = engine.generate(ids, mask, params)
        steps.append(result.stats.decode_s / max(result.stats.steps, 1))
    steps.sort()
    return {
        "path": first.stats.path,
        "fallback_reason": first.stats.fallback_reason,
        "first_call_s": round(first.stats.total_s, 4),
        "step_ms": round(1000 * steps[len(steps) // 2], 4),
        "sequences": result.sequences.cpu(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default per device")
    args = parser.parse_args()

    backend = get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend.device_type != "cpu":
        torch.accelerator.set_device_index(local_rank)
    dist.init_process_group(
        backend.communication_backend_name(),
        device_id=None if backend.device_type == "cpu" else backend.device,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype or default_dtype_name(args.model, backend.device_type)]

    shared = [tempfile.mkdtemp(prefix="graphcap-tp-") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    path = shared[0]
    if rank == 0:
        build_model(args.model, dtype=dtype, device=torch.device("cpu")).save_pretrained(path)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(
        path,
        distributed_config=DistributedConfig(tp_size=world, tp_plan="auto"),
        attn_implementation="sdpa",
        dtype=dtype,
    ).eval()
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)  # EOS off
    ids, mask = prompts(args.batch, args.prompt_len, model.config.vocab_size, backend.device)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, eos_token_id=[])
    group = dist.group.WORLD

    def engine(graphs: bool, m=model, pg=group) -> RolloutEngine:
        config = RolloutConfig(
            enable_graph_capture=graphs, backend=backend, process_group=pg, compile=False
        )
        return RolloutEngine(m, config)

    graph = timed(engine(True), ids, mask, params, args.repeats)
    eager = timed(engine(False), ids, mask, params, 1)
    record = {
        "graph_path": graph["path"],
        "graph_fallback_reason": graph["fallback_reason"],
        "graph_equals_eager": torch.equal(graph["sequences"], eager["sequences"]),
        "tp_graph_step_ms": graph["step_ms"],
        "tp_eager_step_ms": eager["step_ms"],
        "tp_first_call_s": graph["first_call_s"],
    }
    seqs = [None] * world
    dist.all_gather_object(seqs, graph["sequences"])
    record["ranks_equal"] = all(torch.equal(seqs[0], s) for s in seqs)

    recapture = engine(True)
    first = recapture.generate(ids, mask, params)
    changed = SamplingParams(max_new_tokens=args.max_new_tokens, eos_token_id=[], pad_token_id=1)
    second = recapture.generate(ids, mask, changed if rank == 1 else params)
    record["recapture"] = {
        "captures": second.stats.captures,
        "reason": second.stats.recapture_reason,
        "path": second.stats.path,
        "same_tokens": torch.equal(first.sequences, second.sequences),
    }
    records = [None] * world
    dist.all_gather_object(records, record)
    dist.barrier()
    del model, recapture
    backend.empty_cache()

    if rank == 0:
        whole = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(backend.device).eval()
        whole.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)
        single = timed(engine(True, whole, None), ids, mask, params, args.repeats)
        report = {
            "model": args.model,
            "dtype": str(dtype).removeprefix("torch."),
            "world": world,
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens,
            "ranks": records,
            "one_device_graph_step_ms": single["step_ms"],
            "one_device_path": single["path"],
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(json.dumps(report, indent=2), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
