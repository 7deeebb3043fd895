"""The one-row projection kernel equals ``F.linear`` (float64 reference) for every shape the
decode step gives it. Off the GPU it runs under Triton's interpreter, which cannot multiply
bfloat16, so bf16 is checked on the GPU (the same tests run there) and fp32 / fp16 here."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the kernel needs Triton (CUDA builds of torch ship it)")

from graphcap_cuda.kernels import gemv

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


def test_rows_of_a_joined_buffer():
    """A parameter that is a row slice of a joined q/k/v buffer (fuse_projections) is read
    from its own first row, with the buffer's row stride."""
    joined = torch.randn(48, 128, device=DEVICE)
    x = torch.randn(1, 128, device=DEVICE)
    middle = joined[16:40]
    assert gemv.serves(x, middle)
    torch.testing.assert_close(gemv.gemv(x, middle), F.linear(x, middle), rtol=2e-5, atol=2e-5)


def test_columns_of_a_wider_buffer():
    """A weight whose rows are longer in memory than its columns (a column slice) is read with
    its own row stride."""
    wide = torch.randn(24, 200, device=DEVICE)
    x = torch.randn(1, 1, 130, device=DEVICE)
    left = wide[:, :130]
    assert gemv.serves(x, left)
    torch.testing.assert_close(gemv.gemv(x, left), F.linear(x, left), rtol=2e-5, atol=2e-5)


def test_serves_one_row_of_the_weights_dtype_only():
    w = torch.randn(8, 16)
    assert gemv.serves(torch.randn(1, 1, 16), w)
    assert not gemv.serves(torch.randn(2, 1, 16), w)  # two rows: a GEMM's job
    assert not gemv.serves(torch.randn(1, 16, dtype=torch.float64), w)
    assert not gemv.serves(torch.randn(1, 8), torch.randn(16, 8).t())  # columns not contiguous


@pytest.mark.parametrize("n", [1, 100, 4096, 128256])
def test_rows_per_program_stay_in_bounds(n):
    block = gemv.block_rows(n, torch.device("cpu"))
    assert gemv.MIN_BLOCK_N <= block <= gemv.MAX_BLOCK_N and block & (block - 1) == 0
