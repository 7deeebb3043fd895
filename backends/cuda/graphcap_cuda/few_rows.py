"""Few-row projections (``x @ W.T`` for 2 to 64 tokens) in Triton, for decode steps at RL batch
sizes.

A decode step at batch 64 still reads every weight once and does little arithmetic on it:
cuBLAS's GEMMs for llama-8b's q/k/v and o products read the weights at 58-62% of the H200's
bandwidth (run N's profile), and they do not launch dependent, so each waits for the kernel
before it to drain. Here a program holds a tile of W's rows, streams them in blocks of columns
against every row of x (tensor-core products, fp32 accumulation) and, where the tiles alone
are too few to keep the device's loads in flight, the columns are split among several
programs (split-K). The split programs of a tile leave fp32 partials; the one that arrives
last adds them in split order (deterministic) and writes the output, so a product is one
kernel and one graph node. W is the MMA's left operand and x the right one ("swap AB"): the
tile of W rows fills the tensor core's 64-row side, the few tokens its narrow side.

The launcher is a torch custom op (``graphcap_cuda::few_rows``) so that ``torch.compile`` and
operator-level graph recorders see one opaque operation. With ``TRITON_INTERPRET=1`` set
before import it runs on CPU tensors (tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphcap_cuda import launch

#: Most rows of x served; more rows are compute-bound GEMMs, cuBLAS's job.
MAX_ROWS = 64


class Tiling(NamedTuple):
    """Launch settings of one product."""

    block_n: int  # rows of W per program
    block_k: int  # columns per load
    split_k: int  # programs sharing one tile's columns
    stages: int  # software-pipeline depth of the loads
    warps: int


#: Programs to aim for per multiprocessor when choosing the split.
PROGRAMS_PER_SM = 2
BLOCK_N = 64
BLOCK_K = 128
STAGES = 4
WARPS = 4


def tiling(m_rows: int, n_rows: int, k_cols: int, device: torch.device) -> Tiling:
    """The split that gives about ``PROGRAMS_PER_SM`` programs per multiprocessor, at most one
    per block of columns."""
    sms = launch.multiprocessors(device)
    tiles = triton.cdiv(n_rows, BLOCK_N)
    blocks = triton.cdiv(k_cols, BLOCK_K)
    split = max(1, min(blocks, triton.cdiv(PROGRAMS_PER_SM * sms, tiles)))
    return Tiling(BLOCK_N, BLOCK_K, split, STAGES, WARPS)


@triton.jit
def _tile(ptrs, rows_ok, cols, end, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs + cols[None, :], mask=rows_ok[:, None], other=0.0)
    return tl.load(ptrs + cols[None, :], mask=rows_ok[:, None] & (cols < end)[None, :], other=0.0)


@triton.jit
def _few_rows(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    m_rows,
    n_rows,
    k_cols,
    stride_xm,
    stride_wn,
    stride_om,
    split_k,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < n_rows
    m_ok = m < m_rows
    w_rows = w_ptr + n[:, None] * stride_wn
    x_rows = x_ptr + m[:, None] * stride_xm
    per = tl.cdiv(tl.cdiv(k_cols, BLOCK_K), split_k) * BLOCK_K
    begin = split * per
    end = tl.minimum(begin + per, k_cols)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if PDL:
        # No kernel of a step writes the weights: the first block is read while the kernel
        # that writes x finishes, then the program waits for it.
        w = _tile(w_rows, n_ok, begin + k, end, False)
        tl.extra.cuda.gdc_wait()
        x = _tile(x_rows, m_ok, begin + k, end, False)
        acc = _dot(w, tl.trans(x), acc, IEEE)
        begin += BLOCK_K
    for first in range(begin, end, BLOCK_K):
        cols = first + k
        w = _tile(w_rows, n_ok, cols, end, EVEN_K)
        x = _tile(x_rows, m_ok, cols, end, EVEN_K)
        acc = _dot(w, tl.trans(x), acc, IEEE)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if not SPLIT:
        _store(acc, bias_ptr, out_ptr, n, m, n_ok, m_ok, stride_om, HAS_BIAS)
    else:
        # Every thread's partial is stored before the count says so; the split that arrives
        # last adds them (reading the others' stores past L1) and resets the count for the
        # next launch, so a replay needs no zeroing.
        cell = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + m[None, :]
        parts = part_ptr + tile * split_k * BLOCK_N * BLOCK_M
        tl.store(parts + split * BLOCK_N * BLOCK_M + cell, acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.load(parts + cell, cache_modifier=".cg")
            for other in range(1, split_k):  # in split order: the same sums every launch
                total += tl.load(parts + other * BLOCK_N * BLOCK_M + cell, cache_modifier=".cg")
            _store(total, bias_ptr, out_ptr, n, m, n_ok, m_ok, stride_om, HAS_BIAS)
            tl.store(count_ptr + tile, 0)


@triton.jit
def _dot(w, x_t, acc, IEEE: tl.constexpr):
    """fp32 operands multiply in IEEE fp32 (Triton's default would be TF32)."""
    if IEEE:
        return tl.dot(w, x_t, acc, input_precision="ieee")
    return tl.dot(w, x_t, acc)


@triton.jit
def _store(acc, bias_ptr, out_ptr, n, m, n_ok, m_ok, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    at = out_ptr + m[None, :] * stride_om + n[:, None]
    tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def launch_few_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shape: Tiling
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D ``x`` with unit stride in K, with ``shape``."""
    m_rows, k_cols = x.shape
    n_rows = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(m_rows))
    out = torch.empty(m_rows, n_rows, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n_rows, shape.block_n)
    if shape.split_k > 1:
        size = (tiles, shape.split_k, shape.block_n, block_m)
        parts = torch.empty(size, dtype=torch.float32, device=x.device)
        counts = launch.arrival_counts(x.device, tiles)
    else:
        parts = counts = out
    pdl = launch.dependent(x.device)
    _few_rows[(tiles, shape.split_k)](
        x,
        weight,
        out if bias is None else bias,
        out,
        parts,
        counts,
        m_rows,
        n_rows,
        k_cols,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        shape.split_k,
        HAS_BIAS=bias is not None,
        EVEN_K=k_cols % shape.block_k == 0,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=shape.block_n,
        BLOCK_K=shape.block_k,
        SPLIT=shape.split_k > 1,
        PDL=pdl,
        num_warps=shape.warps,
        num_stages=shape.stages,
        launch_pdl=pdl,
    )
    return out


@torch.library.custom_op("graphcap_cuda::few_rows", mutates_args=())
def few_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for an ``x`` of 2 to :data:`MAX_ROWS` rows (shape (..., K)),
    weight (N, K) with unit stride in K. fp32 accumulation."""
    n_rows, k_cols = weight.shape
    rows = x.reshape(-1, k_cols).contiguous()
    shape = tiling(rows.shape[0], n_rows, k_cols, x.device)
    return launch_few_rows(rows, weight, bias, shape).reshape(*x.shape[:-1], n_rows)


@few_rows.register_fake
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
