"""Run Triton kernels under Triton's interpreter where no GPU is present (set before any kernel
module is imported: Triton reads it when a kernel is defined)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
