"""Side experiment for issue 11's batch-1 target: do fused projections pay in the graph step?

Run G's profile put llama-8b's batch-1 GEMMs at 70% of the bandwidth, with cuBLAS split-K
reductions for the small q/k/v and the MLP's gate/up products. This script replaces, in a
copy of each model, q/k/v by one GEMM over their concatenated weights (and gate/up likewise),
then times the captured step with and without, in one process. The fused copy holds its own
weights, so it is a measurement, not a feature: an engine option would have to keep the fused
weights as the parameters' storage, so that trainer updates reach them.

    python3 benchmarks/fused_projections_h200.py OUT.json [--models llama-8b,llama-1b]
    python3 benchmarks/fused_projections_h200.py OUT.json --tiny   # CPU smoke run, fp32

Superseded by ``RolloutConfig(fuse_projections=True)`` (graphcap/rollout/fusion.py, parameters
kept as views of the joined buffer). Kept because run K's ``step_variants_h200.py`` imports its
``fuse`` and ``time_steps`` (benchmarks/results/h200/2026-12-01/step-variants-*.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import graphcap
from graphcap.bench.models import build_model, make_prompts
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedLinear(torch.nn.Module):
    """The first projection of a group: one GEMM for the whole group, whose slices the others
    (called right after it, on the same input, in order) return."""

    def __init__(self, linears: list[torch.nn.Linear]):
        super().__init__()
        assert all(linear.bias is None for linear in linears), "biased projections: not handled"
        self.weight = torch.nn.Parameter(torch.cat([linear.weight for linear in linears]))
        self.sizes = [linear.out_features for linear in linears]
        self.parts: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.parts = list(F.linear(x, self.weight).split(self.sizes, dim=-1))
        return self.parts[0]


class SliceOf(torch.nn.Module):
    """A later projection of a fused group: the slice its group's GEMM computed."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        self.fused, self.index = [fused], index  # a list: not a submodule (no shared params)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused[0].parts[self.index]


def fuse(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every group of projections in ``GROUPS`` fused."""
    fused = copy.deepcopy(model)
    for module in fused.modules():
        for group in GROUPS:
            if all(isinstance(getattr(module, name, None), torch.nn.Linear) for name in group):
                first = FusedLinear([getattr(module, name) for name in group])
                setattr(module, group[0], first)
                for index, name in enumerate(group[1:], start=1):
                    setattr(module, name, SliceOf(first, index))
    return fused


def time_steps(model, backend, batch: int, prompt: int, new: int, repeats: int) -> dict:
    ids, mask = make_prompts(model.config.vocab_size, batch, prompt, 0, backend.device)
    params = SamplingParams(max_new_tokens=new, eos_token_id=[], pad_token_id=0)
    engine = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=backend))
    first = engine.generate(ids, mask, params)
    steps = []
    for _ in range(repeats):
        result = engine.generate(ids, mask, params)
        steps.append(1e3 * result.stats.decode_s / result.stats.steps)
    engine.shutdown()
    return {
        "path": first.stats.path,
        "first_call_s": first.stats.total_s,
        "attention": first.stats.attention,
        "step_ms_median": statistics.median(steps),
        "step_ms_min": min(steps),
        "step_ms_max": max(steps),
        "tokens": result.sequences.cpu(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--models", default="llama-8b,llama-1b")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="tiny-llama, fp32, small sizes (CPU)")
    args = parser.parse_args()
    if args.tiny:
        args.models, args.batch_sizes, args.prompt_len, args.new_tokens = "tiny-llama", "1,4", 8, 8
    backend = graphcap.get_backend()
    dtype = torch.float32 if args.tiny else torch.bfloat16
    report = {"command": " ".join(["python3", *sys.argv]), "device": str(backend.device)}
    report["cases"] = []
    for name in args.models.split(","):
        model = build_model(
            name, dtype=dtype, device=backend.device, backend_seed=backend.manual_seed
        )
        fused = fuse(model)
        for batch in map(int, args.batch_sizes.split(",")):
            sizes = (batch, args.prompt_len, args.new_tokens, args.repeats)
            plain = time_steps(model, backend, *sizes)
            joined = time_steps(fused, backend, *sizes)
            case = {"model": name, "batch": batch}
            for label, out in (("plain", plain), ("fused", joined)):
                case.update({f"{label}_{k}": v for k, v in out.items() if k != "tokens"})
            case["tokens_equal"] = bool(torch.equal(plain["tokens"], joined["tokens"]))
            case["speedup"] = plain["step_ms_median"] / joined["step_ms_median"]
            report["cases"].append(case)
            print(case, flush=True)
            args.json.write_text(json.dumps(report, indent=1))
        del model, fused
        backend.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
