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


def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count, which the kernels' launch shapes are sized by."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100/H200's count: the interpreter on CPU needs some number
