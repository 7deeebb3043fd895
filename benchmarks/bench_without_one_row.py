"""``graphcap bench`` with the CUDA backend's one-row product turned off: the baseline that
run R times the product against, in the same device call.

    python3 benchmarks/bench_without_one_row.py [graphcap bench arguments]
"""

from __future__ import annotations

import sys

from graphcap_cuda.backend import CUDABackend

from graphcap.bench.command import main

CUDABackend.one_row_product = lambda self: None  # compiled captures then use F.linear

if __name__ == "__main__":
    sys.exit(main())
