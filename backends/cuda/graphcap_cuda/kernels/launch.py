"""Programmatic dependent launch (PDL) for the plugin's Triton kernels.

In a captured decode step every kernel waits for the one before it: the device drains the
previous grid, then starts the next one's programs. With PDL (Hopper and later, kept by CUDA
graph capture) a kernel's programs are started while the previous kernel finishes and wait
(``gdc_wait``) only before they read what it wrote. A kernel launched so must call ``gdc_wait``
in every program before it reads any tensor another kernel of the step writes and before it
writes anything; work that reads only what no kernel of the step writes (weights) may go first.
"""

from __future__ import annotations

import functools

import torch

#: Whether the plugin's kernels and inductor's (CUDABackend.compile_options) launch dependent
#: where the device supports it; benchmarks turn it off to time the step without it.
ENABLED = True


def dependent(device: torch.device) -> bool:
    """Whether a kernel on ``device`` launches dependent: a Hopper or later GPU and a Triton
    with grid dependency control (not the CPU interpreter)."""
    return ENABLED and _supported(device)


@functools.cache  # asked at every launch, eager steps included
def _supported(device: torch.device) -> bool:
    import triton.language as tl  # here: the backend imports this module without Triton

    return (
        device.type == "cuda"
        and hasattr(tl.extra.cuda, "gdc_wait")
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


@functools.cache
def use_inductors_ptxas() -> None:
    """Compile this process's Triton kernels with the ptxas inductor uses, from the start.

    Triton keys its kernel cache on the ptxas version it compiles with. Inductor points
    ``TRITON_PTXAS_PATH`` at torch's own ptxas, but only once it compiles a kernel in this
    process: a process whose compiled code came from the compile cache does so at once, while
    one compiling from scratch does its compiling in worker processes and leaves this process
    on Triton's bundled ptxas. The two then keyed the plugin's kernels (and 7 of inductor's)
    differently, so a second process compiled kernels again from a warm cache
    (docs/decisions.md, decisions 36 and 47). Setting it before the first
    kernel compiles, as inductor would, gives every process the same keys."""
    # private: inductor's own setter, so the path and its checks stay torch's
    from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path

    _set_triton_ptxas_path()


def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count, which the kernels' launch shapes are sized by."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # a Hopper GPU's count: the interpreter on CPU needs some number


#: Arrival counts of a launch's cooperating programs (the split-KV chunks of a row and K/V head,
#: the K splits of a product's tile), zero between launches (the last program to arrive resets
#: its count), by (device, stream, size). Launches on one stream never overlap; a graph keeps
#: the address it captured, so a buffer is never freed or replaced. A capture's warm-up makes
#: them, on the capture's stream and outside any memory region.
_COUNTS: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def arrival_counts(device: torch.device, size: int) -> torch.Tensor:
    """The zeroed int32 counts for ``size`` groups of programs on the current stream."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, stream, size)
    if key not in _COUNTS:
        _COUNTS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return _COUNTS[key]
