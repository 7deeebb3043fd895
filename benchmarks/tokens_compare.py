"""Compare two tokens_h200.py reports: which cases (model, batch, variant) give equal tokens.

python benchmarks/tokens_compare.py BEFORE.json AFTER.json
"""

from __future__ import annotations

import json
import sys


def main(before: str, after: str) -> None:
    with open(before) as f:
        old = {(c["model"], c["batch"], c["variant"]): c for c in json.load(f)["cases"]}
    with open(after) as f:
        cases = json.load(f)["cases"]
    for case in cases:
        key = (case["model"], case["batch"], case["variant"])
        ref = old.get((case["model"], case["batch"], "own"))
        same = ref is not None and ref["tokens"] == case["tokens"]
        rows = sum(a == b for a, b in zip(ref["tokens"], case["tokens"], strict=True)) if ref else 0
        step = (
            f"{case['step_ms_median']:.3f} ms [{case['step_ms_min']:.3f}-{case['step_ms_max']:.3f}]"
        )
        before_step = f"{ref['step_ms_median']:.3f} ms" if ref else "-"
        print(
            f"{key}: tokens equal to before: {same} ({rows}/{len(case['tokens'])} rows); "
            f"step {step} (before {before_step}); first call {case['first_call_s']:.3f} s"
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
