"""Where a graph engine's first call spends its time in a fresh process: the first
``generate`` of a new engine under cProfile, then a second call.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) \\
        python3 benchmarks/first_call_profile.py OUT.txt [--model llama-8b] [--batch 1] \\
            [--new-tokens 512] [--attention auto] [--uncompiled] [--[no-]fuse-projections] \\
            [--compile-cache DIR] [--warm-forward] [--no-profile] [--collect-first]

The engine is opened as ``graphcap bench``'s ``graphcap-graph`` mode opens it (the default
configuration: compiled where the backend declares it pays; bf16, 128 prompt tokens);
``--uncompiled`` opens it as ``graphcap-graph-uncompiled``; ``--[no-]fuse-projections`` sets
``fuse_projections`` (default: the backend's). The model is built before the clock starts, as
the bench builds it.
``--attention`` is the engine's ``graph_attention`` (``graphcap_gqa_sdpa``: SDPA's kernel, no
Triton kernel of the plugin's); ``--compile-cache`` its ``compile_cache`` (``none``: torch's
caches only); ``--warm-forward`` runs the bench's one forward of 4 tokens before the clock, as
``graphcap bench`` does. OUT.txt gets both calls' seconds, the engine's stats, the Triton
kernels the first call compiled (entries it added to ``$TRITON_CACHE_DIR``: a kernel listed
after an earlier process compiled it missed Triton's cache), dynamo's and inductor's cache
counters, dynamo's and inductor's own wall-clock phases (``compile_times``: tracing, cache
look-ups, inductor's import, code loading), the 60 costliest functions by cumulative time, the 30
by own time, and what the prefill and the capture called. ``--no-profile`` times the first call
without cProfile (whose overhead more than doubles a warm call's seconds), for wall-clock phases;
``--collect-first`` collects Python's garbage and empties the allocator's cache before the clock,
as ``graphcap bench`` does before each mode. OUT.txt also gets the first call's garbage
collections (count and seconds by generation, from ``gc.callbacks``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch

# private: dynamo's cache counters and phase times have no public API
from torch._dynamo.utils import compile_times, counters

from graphcap.bench.models import make_prompts
from graphcap.preset_models import build_model
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams


def triton_entries() -> dict[str, list[str]]:
    """Triton's cache directory: each entry's hash and the kernel names its metadata names."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    if not root.is_dir():
        return {}
    return {
        entry.name: sorted(p.stem for p in entry.glob("*.json") if not p.name.startswith("__grp"))
        for entry in root.iterdir()
        if entry.is_dir()
    }


class CollectionTimes:
    """A ``gc.callbacks`` entry: count and seconds of the collections, by generation."""

    def __init__(self) -> None:
        self.started = 0.0
        self.spent: dict[int, list[float]] = {}

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            seconds = time.perf_counter() - self.started
            self.spent.setdefault(info["generation"], []).append(seconds)

    def summary(self) -> dict[str, str]:
        return {
            f"generation {gen}": f"{len(times)} in {sum(times):.3f} s (longest {max(times):.3f})"
            for gen, times in sorted(self.spent.items())
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the profile, as text")
    parser.add_argument("--model", default="llama-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--uncompiled", action="store_true", help="compile=False")
    parser.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction)
    parser.add_argument("--compile-cache", default="auto", help="auto, a directory, or none")
    parser.add_argument("--warm-forward", action="store_true")
    parser.add_argument("--no-profile", action="store_true", help="time the first call alone")
    parser.add_argument("--collect-first", action="store_true", help="gc and empty_cache first")
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build_model(args.model, dtype=torch.bfloat16, device=device)
    ids, mask = make_prompts(model.config.vocab_size, args.batch, 128, 0, device)
    if args.warm_forward:
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 4), dtype=torch.long, device=device))
    config = RolloutConfig(
        backend="cuda",
        enable_graph_capture=True,
        fuse_projections=args.fuse_projections,
        graph_attention=args.attention,
        compile=False if args.uncompiled else None,
        compile_cache=None if args.compile_cache == "none" else args.compile_cache,
    )
    engine = RolloutEngine(model, config)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, pad_token_id=0)
    if args.collect_first:
        gc.collect()
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    profile = None if args.no_profile else cProfile.Profile()
    seconds = []
    before = triton_entries()
    collections = CollectionTimes()
    gc.callbacks.append(collections)
    for call in range(2):
        start = time.perf_counter()
        if call == 0 and profile is not None:
            out = profile.runcall(engine.generate, ids, mask, sampling=sampling)
        else:
            out = engine.generate(ids, mask, sampling=sampling)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        print(f"call {call + 1}: {seconds[-1]:.3f} s; stats {out.stats}", flush=True)
        if call == 0:
            compiled = {k: v for k, v in triton_entries().items() if k not in before}
            gc.callbacks.remove(collections)
    text = io.StringIO()
    text.write(f"dynamo and inductor phases (s):\n{compile_times(repr='str')}\n")
    if profile is not None:
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(30)
        stats.print_callees("run_prefill|capture_step|holder.py.*capture")
    kernels = sorted(name for names in compiled.values() for name in names)
    with open(args.out, "w") as handle:
        handle.write(f"first {seconds[0]:.3f} s, second {seconds[1]:.3f} s\n{out.stats}\n")
        handle.write(f"Triton kernels compiled in the first call ({len(kernels)}): {kernels}\n")
        found = {kind: dict(counters[kind]) for kind in ("inductor", "aot_autograd", "stats")}
        handle.write(f"counters: {json.dumps(found, sort_keys=True)}\n")
        handle.write(f"garbage collections in the first call: {collections.summary()}\n")
        handle.write(text.getvalue())
    print(f"Triton kernels compiled in the first call ({len(kernels)}): {kernels}", flush=True)


if __name__ == "__main__":
    main()
