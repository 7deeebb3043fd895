"""``graphcap bench`` with module settings of graphcap_cuda's kernels and inductor's config
changed, so variants of a step are timed with the same command (issue 11, run T).

    GRAPHCAP_KNOBS="launch.ENABLED=0,split_kv.BLOCK_N_FEW_ROWS=64,inductor.combo_kernels=1" \\
        python3 benchmarks/bench_knobs.py [graphcap bench arguments]

Each knob is ``module.NAME=value`` (a graphcap_cuda module), ``graphcap.path.module.NAME=value``
(a core module) or ``inductor.path.to.name=value`` (``torch._inductor.config``); values are
integers (0 / 1 for flags) or ``none``. ``blas=NAME`` sets
``torch.backends.cuda.preferred_blas_library`` (``cublas`` or ``cublaslt``; run AA).
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
import torch._inductor.config

from graphcap.bench.command import main


def apply(knobs: str) -> None:
    for knob in filter(None, knobs.split(",")):
        path, value = knob.split("=")
        if path == "blas":
            torch.backends.cuda.preferred_blas_library(value)
            print(f"knob blas: {torch.backends.cuda.preferred_blas_library()}", file=sys.stderr)
            continue
        *owner, name = path.split(".")
        if owner[0] == "inductor":
            target = torch._inductor.config
            for part in owner[1:]:
                target = getattr(target, part)
        elif owner[0] == "graphcap":
            target = importlib.import_module(".".join(owner))
        else:
            target = importlib.import_module("graphcap_cuda." + ".".join(owner))
        old = getattr(target, name)
        kind = int if old is None else type(old)  # a knob unset by default takes a number
        setattr(target, name, None if value == "none" else kind(int(value)))
        print(f"knob {path}: {old!r} -> {getattr(target, name)!r}", file=sys.stderr)


if __name__ == "__main__":
    apply(os.environ.get("GRAPHCAP_KNOBS", ""))
    sys.exit(main())
