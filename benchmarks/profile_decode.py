"""Where a graph-captured decode step spends its time, and where graph and eager part ways.

For each case (preset, dtype, batch): capture the static graph, then profile two rollouts with
the torch profiler, one of ``--new-tokens`` and one of 2 tokens on the same graph and cache
(one length bucket), and report the difference per decode step, so the prefill drops out: the
kernels launched, the device time by kernel family (GEMM, attention, other), the wall time (host
gaps show as wall minus device) and the achieved weight bandwidth. With ``--compare-eager``,
also compare graph and eager token by token with log-probabilities: the first step where they
differ, the largest log-probability difference before it (0.0: bitwise-equal scores up to that
step), and whether eager decoding on the graph's capture stream gives the graph's tokens.

    python3 benchmarks/profile_decode.py OUT.json [--cases llama-8b:bf16:1,llama-8b:bf16:64] \\
        [--new-tokens 256] [--[no-]fuse-projections] [--uncompiled] [--compare-eager] \\
        [--core-sampler]

A case is ``preset:dtype:batch[:sampling[:draws]]``: ``sampling`` one of :data:`SAMPLINGS`
(default greedy), ``draws`` ``per_row`` (the default) or ``generate`` (``RolloutConfig.draws``),
so the sampler's cost is the difference between cases of one run. Sampled steps truncate and
draw with the backend's fused kernel (``Backend.truncated_draw``) where it offers one;
``--core-sampler`` times the core's PyTorch math instead (the CUDA plugin's ``FUSED_SAMPLER``).

The engine runs the default configuration (compiled captures where the backend declares that
compiling pays, as ``graphcap bench``'s ``graphcap-graph`` mode), or with ``--uncompiled``
plain captures (``graphcap-graph-uncompiled``). With dependent launches a kernel's measured
time includes the time its programs wait for the one before it, so the device times of a
compiled step's kernels can add up to more than the step.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

import graphcap
from graphcap.bench.models import make_prompts
from graphcap.preset_models import DTYPES, build_model
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

FAMILIES = {
    "gemm": ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "cublas"),
    "attention": ("attention", "fmha", "flash", "softmax", "split_kv"),
}


def family(kernel: str) -> str:
    name = kernel.lower()
    return next((fam for fam, keys in FAMILIES.items() if any(k in name for k in keys)), "other")


def device_kernels(engine, ids, mask, params, backend) -> tuple[dict[str, dict[str, float]], Any]:
    """Device time and launch count per kernel name over one profiled call, and the call."""
    backend.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = engine.generate(ids, mask, params)
        backend.synchronize()
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
    return kernels, out


#: The sampling settings a case can name: greedy, temperature 1 with no truncation, top-p, top-k,
#: and temperature 1 through the truncation path (a top-p that keeps every token but the sort).
SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "t1": {"do_sample": True, "temperature": 1.0},
    "topp95": {"do_sample": True, "top_p": 0.95},
    "topk50": {"do_sample": True, "top_k": 50},
    "minp05": {"do_sample": True, "min_p": 0.05},
    "topk50-topp95": {"do_sample": True, "top_k": 50, "top_p": 0.95},
    "t1-truncating": {"do_sample": True, "top_p": 0.999999},
}


@functools.cache
def preset_model(preset: str, dtype: str) -> torch.nn.Module:
    """One model per preset and dtype for every case of a run (cases differ in how they run it)."""
    backend = graphcap.get_backend()
    return build_model(
        preset, dtype=DTYPES[dtype], device=backend.device, backend_seed=backend.manual_seed
    )


def profile_case(
    preset: str,
    dtype: str,
    batch: int,
    prompt: int,
    new: int,
    compare_eager: bool,
    compile: bool | None,
    fuse: bool | None,
    sampling: str = "greedy",
    draws: str = "per_row",
) -> dict[str, Any]:
    backend = graphcap.get_backend()
    model = preset_model(preset, dtype)
    ids, mask = make_prompts(model.config.vocab_size, batch, prompt, 0, backend.device)
    params = SamplingParams(
        max_new_tokens=new, eos_token_id=[], pad_token_id=0, **SAMPLINGS[sampling]
    )
    config = RolloutConfig(
        enable_graph_capture=True,
        backend=backend,
        length_buckets=(prompt + new,),
        compile=compile,
        fuse_projections=fuse,
        draws=draws,
    )
    graph = RolloutEngine(model, config)
    graph.generate(ids, mask, params)  # capture
    full, out = device_kernels(graph, ids, mask, params, backend)
    base, short = device_kernels(graph, ids, mask, replace(params, max_new_tokens=2), backend)
    assert out.stats.captures == short.stats.captures == 1, "both calls must replay one graph"
    steps = out.stats.steps - short.stats.steps
    kernels = {
        name: {
            "count": (k["count"] - base.get(name, {}).get("count", 0)) / steps,
            "device_us": (k["device_us"] - base.get(name, {}).get("device_us", 0.0)) / steps,
        }
        for name, k in full.items()
    }
    per_family: dict[str, float] = {}
    for name, k in kernels.items():
        per_family[family(name)] = per_family.get(family(name), 0.0) + k["device_us"] / 1000
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    decode_ms = 1000 * out.stats.decode_s / out.stats.steps
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["device_us"])[:12]
    result = {
        "preset": preset,
        "compiled": out.stats.compiled,
        "joined_projections": out.stats.fused_projections,
        "dtype": dtype,
        "batch": batch,
        "sampling": sampling,
        "draws": draws,
        "sampler_shape": out.stats.sampler_shape,
        "fused_sampler": backend.truncated_draw() is not None,
        "prompt": prompt,
        "new": new,
        "attention": out.stats.attention,
        "decode_ms_per_step_wall": decode_ms,
        "device_ms_per_step": sum(per_family.values()),
        "kernels_per_step": sum(k["count"] for k in kernels.values()),
        "device_ms_per_step_by_family": per_family,
        "weight_bandwidth_tb_s": weights / (decode_ms / 1000) / 1e12,
        "weights_gb": weights / 1e9,
        "top_kernels_per_step": [{"name": n[:120], **k} for n, k in top],
    }
    if compare_eager:
        result.update(compare_with_eager(model, graph, ids, mask, params, backend))
    return result


def compare_with_eager(model, graph, ids, mask, params, backend) -> dict[str, Any]:
    """Where graph and eager tokens part, and whether the capture stream changes eager's."""
    params = replace(params, return_logprobs=True)
    out = graph.generate(ids, mask, params)
    eager = RolloutEngine(model, RolloutConfig(enable_graph_capture=False, backend=backend))
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
        end = (col - width) if col is not None else params.max_new_tokens
        if end > 0:
            delta = (out.logprobs[row, :end] - reference.logprobs[row, :end]).abs().max()
            diffs.append(float(delta))
    return {
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
    parser.add_argument("--compare-eager", action="store_true", help="graph vs eager tokens too")
    parser.add_argument("--uncompiled", action="store_true", help="compile=False")
    parser.add_argument(
        "--fuse-projections", action=argparse.BooleanOptionalAction, help="default: the backend's"
    )
    parser.add_argument(
        "--core-sampler", action="store_true", help="the core's sampling math, not the kernel"
    )
    args = parser.parse_args()
    if args.core_sampler:
        import graphcap_cuda.backend

        graphcap_cuda.backend.FUSED_SAMPLER = False
    results = []
    for case in args.cases.split(","):
        preset, dtype, batch, *how = case.split(":")
        result = profile_case(
            preset,
            dtype,
            int(batch),
            args.prompt_len,
            args.new_tokens,
            args.compare_eager,
            False if args.uncompiled else None,
            args.fuse_projections,
            *how,
        )
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
