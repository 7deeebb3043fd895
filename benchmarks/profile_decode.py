"""Where a graph-captured decode step spends its time, and where graph and eager part ways.

For each case (preset, dtype, batch): capture the static graph, then profile one whole rollout
with the torch profiler and report, per decode step, the kernels launched, the device time by
kernel family (GEMM, attention, other), the wall time (so host gaps show as wall minus device),
and the achieved weight bandwidth. Then compare graph and eager token by token with
log-probabilities: the first step where they differ, and the largest log-probability difference
seen before it (0.0 means the two paths computed bitwise-equal scores up to that step); and
whether eager decoding on the stream the graph was captured on gives the graph's tokens.

    python benchmarks/profile_decode.py OUT.json [--cases llama-1b:bf16:1,llama-1b:bf16:8]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

import graphcap
from graphcap.bench.models import DTYPES, build_model, make_prompts
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

FAMILIES = {
    "gemm": ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "cublas"),
    "attention": ("attention", "fmha", "flash", "softmax", "split_kv"),
}


def family(kernel: str) -> str:
    name = kernel.lower()
    return next((fam for fam, keys in FAMILIES.items() if any(k in name for k in keys)), "other")


def profile_case(preset: str, dtype: str, batch: int, prompt: int, new: int) -> dict[str, Any]:
    backend = graphcap.get_backend()
    model = build_model(
        preset, dtype=DTYPES[dtype], device=backend.device, backend_seed=backend.manual_seed
    )
    ids, mask = make_prompts(model.config.vocab_size, batch, prompt, 0, backend.device)
    params = SamplingParams(
        max_new_tokens=new, eos_token_id=[], pad_token_id=0, return_logprobs=True
    )
    graph = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=backend))
    eager = RolloutEngine(model, RolloutConfig(enable_graph_capture=False, backend=backend))
    graph.generate(ids, mask, params)  # capture
    backend.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = graph.generate(ids, mask, params)
        backend.synchronize()
    steps = out.stats.steps
    kernels: dict[str, dict[str, float]] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", 0.0)
        if device_us <= 0 or event.key.startswith(("cudaGraphLaunch", "Memcpy", "Memset")):
            continue
        if getattr(event, "device_type", None) is None or "DeviceType.CPU" in str(
            event.device_type
        ):
            continue
        kernels[event.key] = {"count": event.count, "device_us": device_us}
    per_family: dict[str, float] = {}
    for name, k in kernels.items():
        per_family[family(name)] = per_family.get(family(name), 0.0) + k["device_us"]
    total_device_us = sum(per_family.values())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    decode_ms = 1000 * out.stats.decode_s / steps
    reference = eager.generate(ids, mask, params)
    # Same kernels on the stream the graph was captured on: does the stream change the numerics?
    side = backend.capture_stream()
    side.wait_stream(backend.current_stream())
    with backend.stream(side):
        on_side = eager.generate(ids, mask, params)
    backend.synchronize()
    differs = out.sequences != reference.sequences
    first = [int(row.nonzero()[0]) if row.any() else None for row in differs]
    width = ids.shape[1]
    diffs = []
    for row, col in enumerate(first):
        end = (col - width) if col is not None else new
        if end > 0:
            delta = (out.logprobs[row, :end] - reference.logprobs[row, :end]).abs().max()
            diffs.append(float(delta))
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["device_us"])[:12]
    return {
        "preset": preset,
        "dtype": dtype,
        "batch": batch,
        "prompt": prompt,
        "new": new,
        "decode_ms_per_step_wall": decode_ms,
        "device_ms_per_step": total_device_us / 1000 / max(steps, 1),
        "kernels_per_step": sum(k["count"] for k in kernels.values()) / max(steps, 1),
        "device_ms_per_step_by_family": {f: v / 1000 / steps for f, v in per_family.items()},
        "weight_bandwidth_tb_s": weights / (decode_ms / 1000) / 1e12,
        "weights_gb": weights / 1e9,
        "top_kernels": [{"name": n[:120], **k} for n, k in top],
        "graph_equals_eager": not differs.any().item(),
        "eager_on_capture_stream_equals_graph": bool(torch.equal(on_side.sequences, out.sequences)),
        "eager_on_capture_stream_equals_eager": bool(
            torch.equal(on_side.sequences, reference.sequences)
        ),
        "first_divergent_response_step": [None if c is None else c - width for c in first],
        "max_abs_logprob_diff_before_divergence": max(diffs) if diffs else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cases", default="llama-1b:bf16:1,llama-1b:bf16:8,llama-8b:bf16:1")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    results = []
    for case in args.cases.split(","):
        preset, dtype, batch = case.split(":")
        result = profile_case(preset, dtype, int(batch), args.prompt_len, args.new_tokens)
        print(json.dumps(result, indent=1), flush=True)
        results.append(result)
        graphcap.get_backend().empty_cache()
    args.out.write_text(
        json.dumps(
            {
                "device": str(graphcap.get_backend().device),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
                "cases": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
