"""Data-parallel rollouts under torchrun: one engine per rank, prompts split, rows gathered.

    torchrun --nproc-per-node N examples/data_parallel_rollout.py [--model tiny-llama]
        [--prompts 64] [--prompt-len 32] [--max-new-tokens 64] [--no-graphs] [--out rows.pt]

Each rank selects its graphcap backend (GRAPHCAP_BACKEND or auto-detection), binds to the
accelerator of its LOCAL_RANK, joins the job with the backend's collective library (gloo on the
CPU, nccl on CUDA GPUs, hccl on Ascend), builds the same model (a preset of
``graphcap.preset_models`` with seeded random weights, or a local model directory) and the same
prompts, and calls :func:`graphcap.rollout.data_parallel.generate_data_parallel`. Rank 0 prints
one JSON line (rows, new tokens, seconds, tokens/s, the path each rank took) and with ``--out``
saves the gathered rows. docs/distributed.md explains the sharding and the seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from graphcap import get_backend
from graphcap.preset_models import DTYPES, build_model, default_dtype_name
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.data_parallel import generate_data_parallel


def make_prompts(rows: int, width: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Left-padded prompts, the same on every rank: row ``i`` has ``width - i % 4`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, width), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(rows):
        mask[row, : row % 4] = 0
        ids[row, : row % 4] = 0
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama", help="preset name or model directory")
    parser.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default per device)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-graphs", action="store_true", help="run the eager loop")
    parser.add_argument("--warmup", action="store_true", help="one untimed call first")
    parser.add_argument("--out", default=None, help="torch.save the gathered rows here (rank 0)")
    args = parser.parse_args()

    backend = get_backend()
    if backend.device_type != "cpu":
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend.communication_backend_name())
    rank = dist.get_rank()

    dtype = DTYPES[args.dtype or default_dtype_name(args.model, backend.device_type)]
    model = build_model(args.model, dtype=dtype, device=backend.device, seed=0)
    ids, mask = make_prompts(args.prompts, args.prompt_len, model.config.vocab_size)
    engine = RolloutEngine(
        model, RolloutConfig(enable_graph_capture=not args.no_graphs, backend=backend)
    )
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    if args.warmup:
        generate_data_parallel(engine, ids, mask, sampling)
    dist.barrier()
    start = time.perf_counter()
    result = generate_data_parallel(engine, ids, mask, sampling)
    seconds = time.perf_counter() - start
    paths = [None] * dist.get_world_size()
    dist.all_gather_object(paths, result.stats.path)
    if rank == 0:
        tokens = int(result.response_lengths.sum())
        report = {
            "world": dist.get_world_size(),
            "backend": backend.name,
            "model": args.model,
            "rows": int(result.sequences.shape[0]),
            "new_tokens": tokens,
            "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 1),
            "paths": paths,
        }
        print(json.dumps(report), flush=True)
        if args.out:
            torch.save({"sequences": result.sequences, "report": report}, args.out)
    engine.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
