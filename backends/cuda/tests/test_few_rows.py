"""The few-row projection kernel and the product dispatch equal ``F.linear`` (float64
reference) for the shapes a decode step gives them, with and without split-K. Off the GPU it
runs under Triton's interpreter, which cannot multiply bfloat16, so bf16 is checked on the GPU
(the same tests run there) and fp32 / fp16 here."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the kernel needs Triton (CUDA builds of torch ship it)")

from graphcap_cuda import few_rows, launch, products

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool = False):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, w, b


def _check(out, x, w, b, dtype):
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(2, 96, 256), (7, 70, 300), (33, 130, 512), (64, 1000, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_equal_linear(m, n, k, bias, dtype):
    x, w, b = _case(m, n, k, dtype, bias)
    out = few_rows.few_rows(x.reshape(m, 1, k), w, b)
    assert out.shape == (m, 1, n) and out.dtype == dtype
    _check(out.reshape(m, n), x, w, b, dtype)


@pytest.mark.parametrize("split", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("block_k", [64, 128])
def test_every_split_of_the_columns_adds_up(split, block_k):
    """Splits that divide the column blocks and splits that leave a program nothing (8 > 5
    blocks of 64 over 300 columns): the last to arrive adds every partial, on every launch (a
    replay relies on it), and leaves the counts at zero."""
    x, w, b = _case(9, 80, 300, torch.float32, bias=True)
    shape = few_rows.Tiling(block_n=32, block_k=block_k, split_k=split, stages=2, warps=4)
    for _ in range(2):
        _check(few_rows.launch_few_rows(x, w, b, shape), x, w, b, torch.float32)
        assert not launch.arrival_counts(x.device, 3).any()


def test_the_tiling_splits_only_where_tiles_are_few():
    wide = few_rows.tiling(64, 128256, 4096, torch.device("cpu"))
    narrow = few_rows.tiling(64, 4096, 4096, torch.device("cpu"))
    assert wide.split_k == 1
    assert 1 < narrow.split_k <= 4096 // narrow.block_k


@pytest.mark.parametrize("rows", [1, 2, few_rows.MAX_ROWS])
def test_the_dispatch_serves_views_of_joined_buffers(rows):
    """A weight that is a row slice of a joined q/k/v buffer, or a column slice of a wider one,
    is read with its own row stride, one row or several."""
    joined = torch.randn(48, 200, device=DEVICE)
    x = torch.randn(rows, 1, 130, device=DEVICE)
    for w in (joined[16:40, :130], joined[:, 30:160]):
        assert products.serves(x, w)
        out = products.linear(x, w)
        torch.testing.assert_close(out, F.linear(x, w), rtol=2e-5, atol=2e-5)


def test_the_dispatch_leaves_the_rest_to_linear(monkeypatch):
    """More rows than the few-row kernel serves, or a transposed weight: ``F.linear`` computes
    them, not a kernel (nor does it serve an input of another dtype than the weight's)."""

    def refuse(*args):
        raise AssertionError("a kernel was asked for a product it does not serve")

    monkeypatch.setattr(products.few_rows, "few_rows", refuse)
    monkeypatch.setattr(products.gemv, "gemv", refuse)
    w = torch.randn(8, 16, device=DEVICE)
    cases = [
        (torch.randn(few_rows.MAX_ROWS + 1, 16, device=DEVICE), w),
        (torch.randn(2, 16, device=DEVICE), torch.randn(16, 8, device=DEVICE).t()),
    ]
    for x, weight in cases:
        torch.testing.assert_close(products.linear(x, weight), F.linear(x, weight))
    assert not products.serves(*cases[1])
    assert not products.serves(torch.randn(2, 16, dtype=torch.float64, device=DEVICE), w)
