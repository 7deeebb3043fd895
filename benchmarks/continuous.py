"""Continuous batching on one accelerator: eager loop vs captured graph (docs/continuous.md).

Two workloads on a random-init GPT-2 medium shape (fp16 on an accelerator), greedy, no EOS:

1. latency: batch 1, prompt 32, 32 new tokens, one slot. Median whole-call latency and
   tokens/s of the eager continuous loop and of graph replays (graph reused across calls); the
   graph's first call (warm-up + capture) is reported separately. The static graph path is
   measured alongside as a reference.
2. staggered: 64 requests with per-request budgets drawn from [8, 64] through 16 slots, at two
   refill-check intervals. Occupancy (share of slot-steps that produced a token) and
   tokens/s (generated tokens / median call time), eager vs graph. The static graph path runs
   the same requests as a reference, once as one batch of all requests and once in batches of
   the slot count: it has no per-request budget, so every row decodes the largest budget, and
   its tokens/s is reported both for the requested tokens (the budgets' sum, what the
   continuous path generates) and for every token it generated.

3. block_table: the same 64 staggered requests through 16 slots and through 64, on the
   continuous graph path, with today's static cache (``kv_block_size=None``) against the block
   KV table (``kv_block_size``, ``--kv-block-size``, 16 by default): the cache's bytes
   (``engine.cache.nbytes()``: the static buffers, or the block pools as grown), the device's
   peak allocation over the call (``None`` on a CPU), the layout, the most blocks rows held at
   once and the pool growths over all calls, the median decode step time and tokens/s
   with their spread over the steady calls, and whether the graph tokens equal the eager
   loop's on the same layout (and the block table's the static cache's: information only in
   half precision, where the two kernels' chunkings differ). Without
   ``RolloutConfig.kv_block_size`` (an engine before the block table) it reports
   "kv_block_size not available"; ``--require-blocks`` then exits 1.

Every continuous graph result is compared with the eager loop's tokens (`token_equal_to_eager`:
bit-equal where both run the same attention; in half precision with the backend's graph
attention, information only); the static path's agreement (requests whose budgeted tokens
equal the continuous path's) is information only, since fp16 batches of different sizes may
flip near-tied tokens.

    python benchmarks/continuous.py OUT.json            # accelerator from get_backend()
    python benchmarks/continuous.py OUT.json --tiny     # CPU-sized smoke run
    python benchmarks/continuous.py OUT.json --require-blocks   # fail without the block table

Designed to finish in well under 3 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GPT2LMHeadModel

import graphcap
from graphcap.bench.modes import spread, timed_call
from graphcap.preset_models import preset_config
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

FULL = {
    "preset": "gpt2-medium",
    "prompt": 32,
    "new": 32,
    "repeats": 10,
    "staggered_repeats": 3,
    "requests": 64,
    "slots": 16,
    "budget": (8, 64),
    "intervals": (16, 4),
    "block_slots": (16, 64),
    "block_repeats": 5,
}
TINY = {
    "preset": "tiny-gpt2",
    "prompt": 8,
    "new": 8,
    "repeats": 3,
    "staggered_repeats": 2,
    "requests": 12,
    "slots": 4,
    "budget": (2, 12),
    "intervals": (4, 2),
    "block_slots": (4, 12),
    "block_repeats": 2,
}


def measure(call: Any, *, repeats: int, sync: Any) -> tuple[float, Any, float, Any]:
    """The first call timed alone, then ``repeats`` steady calls: (first call's seconds, its
    result, the steady median seconds, the last steady result)."""
    first_s, first = timed_call(call, sync)
    steady = [timed_call(call, sync) for _ in range(repeats)]
    return first_s, first, statistics.median(s for s, _ in steady), steady[-1][1]


def build_model(preset: str, backend: graphcap.Backend) -> torch.nn.Module:
    config = preset_config(preset)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    dtype = torch.float32 if backend.device.type == "cpu" else torch.float16
    return model.to(device=backend.device, dtype=dtype)


def engine(
    model: torch.nn.Module,
    backend: graphcap.Backend,
    graph: bool,
    slots: int | None,
    interval: int = 16,
    **layout: int | None,
) -> RolloutEngine:
    """``layout``: ``kv_block_size=...`` where the block table workload sets it (otherwise the
    engine's default layout, which engines before the block table have no field for)."""
    config = RolloutConfig(
        enable_graph_capture=graph,
        backend=backend,
        continuous_batch_size=slots,
        eos_check_interval=interval,
        **layout,
    )
    return RolloutEngine(model, config)


def latency(model: torch.nn.Module, backend: graphcap.Backend, shape: dict) -> dict[str, Any]:
    """Batch 1: eager continuous loop, continuous graph, static graph."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, shape["prompt"]), device=backend.device)
    params = SamplingParams(max_new_tokens=shape["new"], eos_token_id=[], pad_token_id=0)
    out: dict[str, Any] = {}
    reference = None
    for name, graph, slots in (
        ("continuous_eager", False, 1),
        ("continuous_graph", True, 1),
        ("static_graph", True, None),
    ):
        eng = engine(model, backend, graph, slots)
        first_s, first, median, result = measure(
            lambda eng=eng: eng.generate(ids, sampling=params),
            repeats=shape["repeats"],
            sync=backend.synchronize,
        )
        tokens = int(result.response_lengths.sum())
        if reference is None:
            reference = result.sequences
        out[name] = {
            "path": result.stats.path,
            "first_call_s": first_s,
            "captured_on_first_call": first.stats.captured,
            "median_s": median,
            "tokens_per_s": tokens / median,
            "captures": result.stats.captures,
            "token_equal_to_eager": bool(torch.equal(result.sequences.cpu(), reference.cpu())),
        }
        eng.shutdown()
    return out


def workload(shape: dict, vocab: int) -> tuple[torch.Tensor, list[int]]:
    """The staggered workload's prompts (on the CPU) and per-request budgets (seeded)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (shape["requests"], shape["prompt"]), generator=gen)
    low, high = shape["budget"]
    budgets = torch.randint(low, high + 1, (shape["requests"],), generator=gen).tolist()
    return ids, budgets


def staggered(model: torch.nn.Module, backend: graphcap.Backend, shape: dict) -> dict[str, Any]:
    """Many requests of different lengths through a few slots, eager vs graph."""
    ids, budgets = workload(shape, model.config.vocab_size)
    ids = ids.to(backend.device)
    high = shape["budget"][1]
    params = SamplingParams(max_new_tokens=high, eos_token_id=[], pad_token_id=0)
    out: dict[str, Any] = {"budgets": budgets, "slots": shape["slots"]}
    for interval in shape["intervals"]:
        runs: dict[str, Any] = {}
        reference = None
        for name, graph in (("continuous_eager", False), ("continuous_graph", True)):
            eng = engine(model, backend, graph, shape["slots"], interval)

            def call(eng=eng):
                return eng.generate(ids, sampling=params, request_max_new_tokens=budgets)

            first_s, first, seconds, result = measure(
                call, repeats=shape["staggered_repeats"], sync=backend.synchronize
            )
            if reference is None:
                reference = result.sequences
            tokens = int(result.response_lengths.sum())
            runs[name] = {
                "path": result.stats.path,
                "first_call_s": first_s,
                "captured_on_first_call": first.stats.captured,
                "steady_median_s": seconds,
                "tokens": tokens,
                "tokens_per_s": tokens / seconds,
                "steps": result.stats.steps,
                "occupancy": result.stats.occupancy,
                "slots_refilled": result.stats.slots_refilled,
                "captures": result.stats.captures,
                "token_equal_to_eager": bool(torch.equal(result.sequences.cpu(), reference.cpu())),
            }
            eng.shutdown()
        out[f"eos_check_interval={interval}"] = runs
    out.update(static_reference(model, backend, shape, ids, budgets, reference))
    return out


def static_reference(
    model: torch.nn.Module,
    backend: graphcap.Backend,
    shape: dict,
    ids: torch.Tensor,
    budgets: list[int],
    continuous: torch.Tensor,
) -> dict[str, Any]:
    """The static graph path on the staggered requests, as one batch and in slot-sized ones."""
    width = ids.shape[1]
    params = SamplingParams(max_new_tokens=max(budgets), eos_token_id=[], pad_token_id=0)
    out: dict[str, Any] = {}
    for name, batch in (
        ("static_graph_one_batch", len(budgets)),
        ("static_graph_slot_batches", shape["slots"]),
    ):
        eng = engine(model, backend, True, None)
        chunks = [ids[i : i + batch] for i in range(0, len(budgets), batch)]

        def call(eng=eng, chunks=chunks):
            return [eng.generate(chunk, sampling=params) for chunk in chunks]

        first_s, first, seconds, results = measure(
            call, repeats=shape["staggered_repeats"], sync=backend.synchronize
        )
        sequences = torch.cat([r.sequences for r in results]).cpu()
        agree = sum(
            torch.equal(sequences[i, : width + n], continuous[i, : width + n].cpu())
            for i, n in enumerate(budgets)
        )
        generated = sum(int(r.response_lengths.sum()) for r in results)
        out[name] = {
            "path": results[0].stats.path,
            "batch": batch,
            "first_call_s": first_s,
            "captured_on_first_call": first[0].stats.captured,
            "steady_median_s": seconds,
            "requested_tokens_per_s": sum(budgets) / seconds,
            "generated_tokens": generated,
            "generated_tokens_per_s": generated / seconds,
            "requests_equal_to_continuous": agree,
        }
        eng.shutdown()
    return out


#: What the block table workload reports on an engine without ``RolloutConfig.kv_block_size``.
NO_BLOCKS = "kv_block_size not available"


def block_table(
    model: torch.nn.Module, backend: graphcap.Backend, shape: dict, block_size: int
) -> dict[str, Any]:
    """The staggered requests through each slot count, static cache against block table."""
    if "kv_block_size" not in RolloutConfig.__dataclass_fields__:
        return {"skipped": NO_BLOCKS}
    ids, budgets = workload(shape, model.config.vocab_size)
    ids = ids.to(backend.device)
    params = SamplingParams(max_new_tokens=shape["budget"][1], eos_token_id=[], pad_token_id=0)
    out: dict[str, Any] = {"budgets": budgets, "kv_block_size": block_size}
    for slots in shape["block_slots"]:
        runs: dict[str, Any] = {}
        for name, size in (("static_cache", None), ("block_table", block_size)):
            runs[name] = layout_run(model, backend, shape, ids, budgets, params, slots, size)
        static, blocks = runs["static_cache"], runs["block_table"]
        blocks["cache_bytes_vs_static"] = blocks["cache_bytes"] / static["cache_bytes"]
        blocks["token_equal_to_static_graph"] = bool(
            torch.equal(blocks.pop("sequences"), static.pop("sequences"))
        )
        out[f"slots={slots}"] = runs
    return out


def layout_run(
    model: torch.nn.Module,
    backend: graphcap.Backend,
    shape: dict,
    ids: torch.Tensor,
    budgets: list[int],
    params: SamplingParams,
    slots: int,
    block_size: int | None,
) -> dict[str, Any]:
    """One cache layout on the continuous graph path (steady calls after a capturing one),
    checked against the eager loop on the same layout."""

    def call(eng: RolloutEngine) -> Any:
        return eng.generate(ids, sampling=params, request_max_new_tokens=budgets)

    eager = engine(model, backend, False, slots, kv_block_size=block_size)
    reference = call(eager).sequences.cpu()
    eager.shutdown()
    eng = engine(model, backend, True, slots, kv_block_size=block_size)
    first_s, first = timed_call(lambda: call(eng), backend.synchronize)
    backend.reset_peak_memory_stats()
    steady = [
        timed_call(lambda: call(eng), backend.synchronize) for _ in range(shape["block_repeats"])
    ]
    peak = backend.max_memory_allocated()
    result = steady[-1][1]
    tokens = int(result.response_lengths.sum())
    step_s = spread(r.stats.decode_s / r.stats.steps for _, r in steady if r.stats.steps)
    tokens_per_s = spread(tokens / seconds for seconds, _ in steady)
    out = {
        "path": result.stats.path,
        "first_call_s": first_s,
        "captured_on_first_call": first.stats.captured,
        "captures": result.stats.captures,
        "cache_bytes": eng.cache.nbytes() if eng.cache is not None else None,
        "kv_layout": result.stats.kv_layout,
        "kv_blocks_held": result.stats.kv_blocks_held,
        "kv_pool_growths": first.stats.kv_pool_growths
        + sum(r.stats.kv_pool_growths for _, r in steady),
        "peak_allocated_bytes": peak,
        "step_s_median_min_max": step_s,
        "tokens": tokens,
        "tokens_per_s_median_min_max": tokens_per_s,
        "token_equal_to_eager": bool(torch.equal(result.sequences.cpu(), reference)),
        "sequences": result.sequences.cpu(),
    }
    eng.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where to write the JSON results")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized smoke run")
    parser.add_argument(
        "--kv-block-size", type=int, default=16, help="block size of the block table workload"
    )
    parser.add_argument(
        "--require-blocks",
        action="store_true",
        help=f'exit 1 when the engine has no block table ("{NO_BLOCKS}")',
    )
    args = parser.parse_args()
    shape = TINY if args.tiny else FULL
    backend = graphcap.get_backend()
    started = time.perf_counter()
    model = build_model(shape["preset"], backend)
    with torch.no_grad():
        results = {
            "backend": backend.name,
            "device": str(backend.device),
            "dtype": str(next(model.parameters()).dtype),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "shape": dict(shape),
            "latency_batch1": latency(model, backend, shape),
            "staggered": staggered(model, backend, shape),
            "block_table": block_table(model, backend, shape, args.kv_block_size),
        }
    results["elapsed_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    if args.require_blocks and results["block_table"].get("skipped") == NO_BLOCKS:
        raise SystemExit(f"--require-blocks: {NO_BLOCKS} (RolloutConfig has no such field)")


if __name__ == "__main__":
    main()
