"""Where a first call's "capture" phase goes, outside the warm-up: first_call_profile.py's run
(its arguments after this script's OUT.json) with wall-clock timers around what a compiled
capture does after its warm-up: emptying the allocator's cache, the graph's capture_begin /
capture_end, Python's gc, and writing the compile cache. A diagnostic kept beside its output.

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

spent: dict[str, list[float]] = collections.defaultdict(list)


def timed(owner, name, label):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            spent[label].append(round(time.perf_counter() - start, 4))

    setattr(owner, name, wrapper)


timed(torch.cuda, "empty_cache", "empty_cache")
timed(torch.cuda.memory, "empty_cache", "memory.empty_cache")
timed(torch.cuda.CUDAGraph, "capture_begin", "capture_begin")
timed(torch.cuda.CUDAGraph, "capture_end", "capture_end")
timed(torch.compiler, "save_cache_artifacts", "save_cache_artifacts")
timed(torch.compiler, "load_cache_artifacts", "load_cache_artifacts")
timed(gc, "collect", "gc.collect")

out, script = sys.argv[1], sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    before = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    with open(out, "w") as handle:
        json.dump({"seconds": spent, "cached_unused_bytes_at_end": before}, handle, indent=1)
    print(json.dumps(spent), flush=True)
