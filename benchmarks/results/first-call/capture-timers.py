"""Where a first call's "capture" phase goes, outside the warm-up: first_call_profile.py's run
(its arguments after this script's OUT.json) with wall-clock timers around what a compiled
capture does after its warm-up: emptying the allocator's cache, the graph's capture_begin /
capture_end, Python's garbage collections (each automatic one, with its generation, through
``gc.callbacks``), and writing the compile cache. Nothing inside a capture synchronises (the
capture_begin / capture_end times are the host's). A diagnostic kept beside its output.

    python3 capture-timers.py OUT.json benchmarks/first_call_profile.py OUT.txt [ARGS...]
"""

import collections
import functools
import gc
import json
import runpy
import sys
import time

import torch

from graphcap.rollout import RolloutEngine

spent: dict[str, list[float]] = collections.defaultdict(list)
#: Whether a generate call is running (timings are labelled "in a call" or "outside").
inside = [False]


def where(label):
    return f"{label} ({'in a call' if inside[0] else 'outside'})"


def timed(owner, name, label, sync=True):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if sync:
                torch.cuda.synchronize()
            spent[where(label)].append(round(time.perf_counter() - start, 4))

    setattr(owner, name, wrapper)


collection_start = [0.0]


def collections_timed(phase, info):
    if phase == "start":
        collection_start[0] = time.perf_counter()
    else:
        seconds = round(time.perf_counter() - collection_start[0], 4)
        spent[where(f"gc generation {info['generation']}")].append(seconds)


gc.callbacks.append(collections_timed)


timed(torch.cuda, "empty_cache", "empty_cache")
timed(torch.cuda.memory, "empty_cache", "memory.empty_cache")
timed(torch.cuda.CUDAGraph, "capture_begin", "capture_begin", sync=False)
timed(torch.cuda.CUDAGraph, "capture_end", "capture_end", sync=False)
timed(torch.compiler, "save_cache_artifacts", "save_cache_artifacts")
timed(torch.compiler, "load_cache_artifacts", "load_cache_artifacts")
original_generate = RolloutEngine.generate


def generate(*args, **kwargs):
    inside[0] = True
    try:
        return original_generate(*args, **kwargs)
    finally:
        inside[0] = False


RolloutEngine.generate = generate

out, script = sys.argv[1], sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    before = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    with open(out, "w") as handle:
        json.dump({"seconds": spent, "cached_unused_bytes_at_end": before}, handle, indent=1)
    print(json.dumps(spent), flush=True)
