"""The one-row projection kernel equals ``F.linear`` (float64 reference) for every shape the
decode step gives it. Off the GPU it runs under Triton's interpreter, which cannot multiply
bfloat16, so bf16 is checked on the GPU (the same tests run there) and fp32 / fp16 here."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the kernel needs Triton (CUDA builds of torch ship it)")

from graphcap_cuda import gemv

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(96, 256), (70, 300), (3, 512), (1000, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_equals_linear(n, k, bias, dtype):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, 1, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    out = gemv.gemv(x, w, b)
    assert out.shape == (1, 1, n) and out.dtype == dtype
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [1, 100, 4096, 128256])
def test_rows_per_program_stay_in_bounds(n):
    block = gemv.block_rows(n, torch.device("cpu"))
    assert gemv.MIN_BLOCK_N <= block <= gemv.MAX_BLOCK_N and block & (block - 1) == 0
