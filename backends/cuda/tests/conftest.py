"""Make the core's tiny model builders (tests/rollout_models.py) importable from these tests,
and run Triton kernels under Triton's interpreter where no GPU is present (set before any
kernel module is imported: Triton reads it when a kernel is defined)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CORE_TESTS = Path(__file__).resolve().parents[3] / "tests"
if str(CORE_TESTS) not in sys.path:
    sys.path.insert(0, str(CORE_TESTS))
