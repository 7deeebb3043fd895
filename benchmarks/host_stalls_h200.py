"""Why the compiled step ran slower after HF's compile in the same process (issue 11, run Z).

Run X measured llama-8b's compiled batch-1 step at 4.29 ms after HF static cache + compile and
the default graph in one process, and 4.22 ms alone. Two host-side suspects are timed here, in
one process after HF, on one compiled engine, alternating calls:

- the cyclic garbage collector: a full pass over the objects HF's compile left (the collector
  runs when allocations cross its thresholds, whatever the loop is doing), recorded with
  ``gc.callbacks`` (collections and their time per call) and timed with it paused;
- the periodic finished-rows read (``eos_check_interval``): each read waits for the device, so
  the queue of launched steps drains every interval; a second engine's interval exceeds the call.

    python benchmarks/host_stalls_h200.py OUT.json [--model llama-8b] [--calls 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import replace

import graphcap
from graphcap.bench.models import DTYPES, build_model, make_prompts
from graphcap.bench.modes import MODES, Workload, spread
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams


class Collections:
    """Generation-2 collections and their seconds, per call (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = 0, 0.0, 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._start

    def take(self) -> dict:
        out = {"gen2_collections": self.count, "gen2_ms": self.seconds * 1e3}
        self.count, self.seconds = 0, 0.0
        return out


def timed_calls(engine, work, params, calls: int, seen: Collections) -> dict:
    """Step ms of ``calls`` calls with the collector on and off, alternating."""
    engine.generate(work.input_ids, work.attention_mask, params)  # capture and compile
    rows = {"gc_on": [], "gc_off": []}
    for _ in range(calls):
        for label in rows:
            if label == "gc_on":
                gc.enable()
            else:
                gc.disable()
            seen.take()
            out = engine.generate(work.input_ids, work.attention_mask, params)
            step_ms = out.stats.decode_s / out.stats.steps * 1e3
            rows[label].append({"step_ms": step_ms, **seen.take()})
    gc.enable()
    return {
        label: {"median_step_ms": spread(r["step_ms"] for r in runs), "calls": runs}
        for label, runs in rows.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="llama-8b")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    backend = graphcap.get_backend()
    model = build_model(args.model, dtype=DTYPES["bf16"], device=backend.device)
    ids, mask = make_prompts(model.config.vocab_size, 1, 128, 0, backend.device)
    work = Workload(model, backend, ids, mask, 512, fuse_projections=True)
    seen = Collections()
    report: dict = {"model": args.model, "objects_before_hf": len(gc.get_objects())}
    with MODES["hf-static-compile"].session(work) as call:
        hf = [call().decode_step_s * 1e3 for _ in range(args.calls + 1)][1:]
    report["hf_static_compile_step_ms"] = spread(hf)
    report["objects_after_hf"] = len(gc.get_objects())
    params = SamplingParams(max_new_tokens=512, pad_token_id=0)
    config = RolloutConfig(
        backend=backend, enable_graph_capture=True, compile=True, fuse_projections=True
    )
    for name, interval in (("interval_16", 16), ("no_read", 10**9)):
        engine = RolloutEngine(model, replace(config, eos_check_interval=interval))
        report[name] = timed_calls(engine, work, params, args.calls, seen)
        engine.shutdown()
        print(name, {k: v["median_step_ms"] for k, v in report[name].items()}, flush=True)
    print("hf", report["hf_static_compile_step_ms"])
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
