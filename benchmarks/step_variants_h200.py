"""Side experiment for issue 11: which fusion pays in the captured decode step?

Times the static graph's decode step of each preset under variants of the same weights, in one
process: ``plain`` (the model as built), ``fused`` (q/k/v and gate/up as one GEMM each, see
fused_projections_h200.py), ``regional`` (every RMSNorm and MLP module compiled with
``torch.compile(dynamic=False)``, so their elementwise work runs as few kernels; attention and
the rest stay eager), ``layers`` (whole decoder layers compiled: PyTorch's regional-compilation
recipe) and the fused form of the last two. Reports the step (median, min, max), the first call
(compilation included) and whether greedy tokens equal the plain model's.

    python3 benchmarks/step_variants_h200.py OUT.json [--models llama-8b,llama-1b]
    python3 benchmarks/step_variants_h200.py OUT.json --tiny   # CPU smoke run, fp32
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from fused_projections_h200 import fuse, time_steps

import graphcap
from graphcap.bench.models import build_model

REGIONS = ("RMSNorm", "MLP")


def regional(model: torch.nn.Module, layers: bool = False) -> torch.nn.Module:
    """A copy of ``model`` whose RMSNorm and MLP modules (``layers``: whole decoder layers, the
    classes in ``_no_split_modules``) run compiled."""
    copied = copy.deepcopy(model)
    names = tuple(model._no_split_modules) if layers else REGIONS
    for module in copied.modules():
        if type(module).__name__.endswith(names):
            module.compile(dynamic=False)
    return copied


VARIANTS = {
    "plain": lambda m: m,
    "fused": fuse,
    "regional": regional,
    "fused+regional": lambda m: regional(fuse(m)),
    "layers": lambda m: regional(m, layers=True),
    "fused+layers": lambda m: regional(fuse(m), layers=True),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--models", default="llama-8b,llama-1b")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--tiny", action="store_true", help="tiny-llama, fp32, small sizes (CPU)")
    args = parser.parse_args()
    if args.tiny:
        args.models, args.batch_sizes, args.prompt_len, args.new_tokens = "tiny-llama", "1,4", 8, 8
    torch._dynamo.config.recompile_limit = 64  # a shape per batch size and per prefill/step
    backend = graphcap.get_backend()
    dtype = torch.float32 if args.tiny or args.dtype == "fp32" else torch.bfloat16
    report = {"command": " ".join(["python3", *sys.argv]), "device": str(backend.device)}
    report["cases"] = []
    for name in args.models.split(","):
        model = build_model(
            name, dtype=dtype, device=backend.device, backend_seed=backend.manual_seed
        )
        plain: dict[int, dict] = {}
        for variant in args.variants.split(","):
            changed = VARIANTS[variant](model)
            for batch in map(int, args.batch_sizes.split(",")):
                out = time_steps(
                    changed, backend, batch, args.prompt_len, args.new_tokens, args.repeats
                )
                tokens = out.pop("tokens")
                base = plain.setdefault(batch, {**out, "tokens": tokens})
                case = {"model": name, "variant": variant, "batch": batch, **out}
                case["speedup"] = base["step_ms_median"] / out["step_ms_median"]
                case["tokens_equal"] = bool(torch.equal(base["tokens"], tokens))
                report["cases"].append(case)
                print(case, flush=True)
                args.json.write_text(json.dumps(report, indent=1))
            del changed
            backend.empty_cache()
        del model
        backend.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
