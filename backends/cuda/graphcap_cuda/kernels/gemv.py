"""One-row projections (``x @ W.T`` for a single token) in Triton, for batch-1 decode.

At batch 1 a decode step is a chain of matrix-vector products, bound by reading the weights.
cuBLAS picks GEMM tiles for them that read the weights well below the device's bandwidth, with
split-K reductions as extra kernels. Here each program reduces a few whole rows of W: it
streams its rows in blocks of columns, multiplies by the one input row and keeps fp32 partial
sums, then adds them once at the end. Enough programs are launched to keep the device's loads
in flight (docs/decisions.md, decision 20).

The kernel also takes the elementwise work a decode layer does right before and after a
product, which inductor cannot fuse into a custom op (graphcap_cuda.kernels.epilogues moves it
here): a gated MLP's ``act(x @ gate.T) * (x @ W.T)`` (``act`` one of :data:`ACTIVATIONS`), a
residual add, and, before it, the RMSNorm of its input (one of :data:`NORMS`), where the input
may be the sum of two tensors (the residual add after attention): every program reads the
whole input row to find its norm, which costs L2 reads, not a kernel launch.

The launcher is a torch custom op (``graphcap_cuda::gemv``) so that ``torch.compile`` and
operator-level graph recorders see one opaque operation. With ``TRITON_INTERPRET=1`` set
before import it runs on CPU tensors (tests).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from graphcap_cuda.kernels import launch

launch.use_inductors_ptxas()

#: Launch settings, from a sweep over batch-1 products: rows of W per program the power of two
#: nearest to N / (6 programs per multiprocessor), within [2, 8], and 512 columns a load. A
#: rule close to the best setting per product, which only timing each product at its first
#: call could know (docs/decisions.md, decision 20).
BLOCK_K = 512
PROGRAMS_PER_SM = 6
MIN_BLOCK_N = 2
MAX_BLOCK_N = 8
NUM_WARPS = 4
#: Columns a load of the gated form (two rows per output) over K of at least
#: ``GATED_LONG_K``: long rows keep the gated product level with the plain one at 256, short
#: ones at 512 (docs/decisions.md, decision 23).
GATED_BLOCK_K = 256
GATED_LONG_K = 4096
#: The gated form's activations by name (Llama's SiLU; Gemma's tanh-approximated GELU), as
#: the kernel's ``ACTIVATION`` number.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
#: The RMSNorms the kernel can apply to its input, as its ``NORM`` number: ``rms`` is Llama's
#: ``w * (x * rstd).to(dtype)``, ``rms_one_plus`` Gemma's ``(x * rstd * (1 + w)).to(dtype)``
#: (``rstd = rsqrt(mean(x**2) + eps)``, in fp32).
NORMS = {"rms": 1, "rms_one_plus": 2}
#: Whether a program reads the input row for its norm in one load of up to ``MAX_NORM_ROW``
#: columns (a power of two) rather than block by block (benchmarks turn it off).
NORM_ONE_LOAD = True
MAX_NORM_ROW = 16384


@triton.jit
def _weights(rows, cols, n_ok, k_cols, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(rows + cols[None, :], mask=n_ok[:, None], other=0.0)
    return tl.load(rows + cols[None, :], mask=n_ok[:, None] & (cols < k_cols)[None, :], other=0.0)


@triton.jit
def _inputs(x_ptr, cols, k_cols, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptr + cols)
    return tl.load(x_ptr + cols, mask=cols < k_cols, other=0.0)


@triton.jit
def _summed(x_ptr, addend_ptr, cols, k_cols, EVEN_K: tl.constexpr, HAS_ADDEND: tl.constexpr):
    """x's block in fp32 (``x + addend`` rounded to x's dtype, as eager's add rounds it)."""
    x = _inputs(x_ptr, cols, k_cols, EVEN_K)
    if HAS_ADDEND:
        x = (x.to(tl.float32) + _inputs(addend_ptr, cols, k_cols, EVEN_K).to(tl.float32)).to(
            x.dtype
        )
    return x.to(tl.float32)


@triton.jit
def _rstd(
    x_ptr,
    addend_ptr,
    k_cols,
    eps,
    EVEN_K: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW: tl.constexpr,
):
    """``rsqrt(mean(x**2) + eps)`` over the whole input row, before the product's loop: in one
    load of ``ROW`` columns (a power of two at least K), or block by block where ``ROW`` is 0.
    Both forms beat the norm's own kernel; one load is the faster (docs/decisions.md,
    decision 24)."""
    if ROW > 0:
        whole = _summed(x_ptr, addend_ptr, tl.arange(0, ROW), k_cols, False, HAS_ADDEND)
        total = tl.sum(whole * whole, axis=0)
    else:
        k = tl.arange(0, BLOCK_K)
        squares = tl.zeros([BLOCK_K], tl.float32)
        for first in range(0, k_cols, BLOCK_K):
            part = _summed(x_ptr, addend_ptr, first + k, k_cols, EVEN_K, HAS_ADDEND)
            squares += part * part
        total = tl.sum(squares, axis=0)
    return tl.rsqrt(total / k_cols + eps)


@triton.jit
def _row(
    x_ptr,
    addend_ptr,
    norm_ptr,
    cols,
    k_cols,
    rstd,
    EVEN_K: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    NORM: tl.constexpr,
):
    """The product's input block in fp32: x (or x + addend), normalised where NORM is set,
    rounded where eager's separate ops round."""
    x = _summed(x_ptr, addend_ptr, cols, k_cols, EVEN_K, HAS_ADDEND)
    if NORM == 0:
        return x
    dtype = x_ptr.dtype.element_ty
    w = _inputs(norm_ptr, cols, k_cols, EVEN_K).to(tl.float32)
    if NORM == 1:  # w * (x * rstd).to(dtype)
        return (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return (x * rstd * (1.0 + w)).to(dtype).to(tl.float32)  # (x * rstd * (1 + w)).to(dtype)


@triton.jit
def _gemv(
    x_ptr,
    w_ptr,
    bias_ptr,
    gate_ptr,
    gate_bias_ptr,
    residual_ptr,
    addend_ptr,
    residual_addend_ptr,
    norm_ptr,
    out_ptr,
    n_rows,
    k_cols,
    stride_wn,
    stride_gn,
    eps,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    HAS_GATE_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    HAS_RESIDUAL_ADDEND: tl.constexpr,
    ACTIVATION: tl.constexpr,
    NORM: tl.constexpr,
    NORM_ROW: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILE_N: tl.constexpr,
    PDL: tl.constexpr,
):
    # A program reduces TILE_N rows of W: BLOCK_N output rows, or, gated, each output's gate
    # row and W row interleaved (one load stream and one accumulator, as many bytes in flight
    # as the plain kernel; two streams were slower, docs/decisions.md, decision 23).
    t = tl.arange(0, TILE_N)
    n = tl.program_id(0) * BLOCK_N + (t // 2 if GATED else t)
    n_ok = n < n_rows
    rows = w_ptr + n[:, None] * stride_wn
    if GATED:
        rows = tl.where((t % 2 == 1)[:, None], rows, gate_ptr + n[:, None] * stride_gn)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([TILE_N, BLOCK_K], tl.float32)
    start = 0
    if PDL:
        # No kernel of a step writes the weights: the first block is read while the kernel
        # that writes x finishes, then the program waits for it (two blocks: no faster).
        w = _weights(rows, k, n_ok, k_cols, EVEN_K)
        tl.extra.cuda.gdc_wait()
    rstd = 1.0
    if NORM != 0:
        rstd = _rstd(x_ptr, addend_ptr, k_cols, eps, EVEN_K, HAS_ADDEND, BLOCK_K, NORM_ROW)
    if PDL:
        x = _row(x_ptr, addend_ptr, norm_ptr, k, k_cols, rstd, EVEN_K, HAS_ADDEND, NORM)
        acc += w.to(tl.float32) * x[None, :]
        start = BLOCK_K
    for first in range(start, k_cols, BLOCK_K):
        cols = first + k
        # W's block before x's: the other order made the compiled step much slower
        # (docs/decisions.md, decision 20).
        w = _weights(rows, cols, n_ok, k_cols, EVEN_K)
        x = _row(x_ptr, addend_ptr, norm_ptr, cols, k_cols, rstd, EVEN_K, HAS_ADDEND, NORM)
        acc += w.to(tl.float32) * x[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    out = tl.sum(acc, axis=1)
    if GATED:
        gate, out = tl.split(tl.reshape(out, (BLOCK_N, 2)))
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < n_rows
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    # Each step below rounds to the output dtype where eager PyTorch's separate ops round.
    if GATED:  # act(x @ gate.T) * (x @ w.T)
        if HAS_GATE_BIAS:
            gate += tl.load(gate_bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        gate = gate.to(dtype).to(tl.float32)
        if ACTIVATION == 0:  # silu
            act = gate / (1.0 + tl.exp(-gate))
        else:  # gelu, tanh approximation; tanh(y) = 1 - 2 / (exp(2y) + 1)
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
        out = act.to(dtype).to(tl.float32) * out.to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL_ADDEND:
            other = tl.load(residual_addend_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
            residual = (residual + other).to(dtype).to(tl.float32)
        out = out.to(dtype).to(tl.float32) + residual
    tl.store(out_ptr + n, out.to(dtype), mask=n_ok)


def norm_row(k_cols: int) -> int:
    """Columns of the one load that finds the input's norm (0: block by block)."""
    row = triton.next_power_of_2(k_cols)
    return row if NORM_ONE_LOAD and row <= MAX_NORM_ROW else 0


def block_rows(n_rows: int, device: torch.device) -> int:
    """Rows of W per program: the power of two in [MIN_BLOCK_N, MAX_BLOCK_N] nearest to giving
    ``PROGRAMS_PER_SM`` programs per multiprocessor."""
    sms = launch.multiprocessors(device)
    wanted = max(1.0, n_rows / (PROGRAMS_PER_SM * sms))
    return min(MAX_BLOCK_N, max(MIN_BLOCK_N, 1 << round(math.log2(wanted))))


@torch.library.custom_op("graphcap_cuda::gemv", mutates_args=())
def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    gate_bias: torch.Tensor | None = None,
    activation: str = "silu",
    norm: str | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    addend: torch.Tensor | None = None,
    residual_addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for an ``x`` holding one row (shape (..., K) with every
    leading size 1); weight (N, K) with unit stride in K. fp32 accumulation. With ``gate``
    (N, K): ``act(F.linear(x, gate, gate_bias)) * F.linear(x, weight, bias)`` (a gated MLP's
    activation, ``act`` named by ``activation``, a key of :data:`ACTIVATIONS`); with
    ``residual`` (N values): ``residual +`` the result. Before the product: ``x + addend``
    instead of x, then, with ``norm`` (a key of :data:`NORMS`), its RMSNorm with weight
    ``norm_weight`` (K values) and ``eps``; ``residual + residual_addend`` instead of residual.
    Intermediates are rounded to x's dtype as the separate eager ops round them
    (graphcap_cuda.kernels.epilogues moves these ops here)."""
    n_rows, k_cols = weight.shape
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    if gate is not None and (gate.shape != weight.shape or gate.stride(1) != 1):
        raise ValueError(f"gate {tuple(gate.shape)} must have weight's shape {tuple(weight.shape)}")
    _check_row("residual", residual, n_rows, x.dtype)
    _check_row("residual_addend", residual_addend, n_rows, x.dtype)
    _check_row("addend", addend, k_cols, x.dtype)
    if residual_addend is not None and residual is None:
        raise ValueError("residual_addend needs a residual to add to")
    if (norm is None) != (norm_weight is None) or (norm is not None and norm not in NORMS):
        raise ValueError(f"norm {norm!r} needs a norm_weight and one of {sorted(NORMS)}")
    _check_row("norm_weight", norm_weight, k_cols, x.dtype)
    vector = x.reshape(k_cols).contiguous()
    out = torch.empty(n_rows, dtype=x.dtype, device=x.device)
    block_n = block_rows(n_rows, x.device)
    block_k = GATED_BLOCK_K if gate is not None and k_cols >= GATED_LONG_K else BLOCK_K
    pdl = launch.dependent(x.device)

    def flat(tensor: torch.Tensor | None, rows: int) -> torch.Tensor:
        return out if tensor is None else tensor.reshape(rows).contiguous()

    _gemv[(triton.cdiv(n_rows, block_n),)](
        vector,
        weight,
        out if bias is None else bias,
        weight if gate is None else gate,
        out if gate_bias is None else gate_bias,
        flat(residual, n_rows),
        vector if addend is None else addend.reshape(k_cols).contiguous(),
        flat(residual_addend, n_rows),
        vector if norm_weight is None else norm_weight.reshape(k_cols).contiguous(),
        out,
        n_rows,
        k_cols,
        weight.stride(0),
        weight.stride(0) if gate is None else gate.stride(0),
        eps,
        HAS_BIAS=bias is not None,
        GATED=gate is not None,
        HAS_GATE_BIAS=gate_bias is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_ADDEND=addend is not None,
        HAS_RESIDUAL_ADDEND=residual_addend is not None,
        ACTIVATION=ACTIVATIONS[activation],
        NORM=0 if norm is None else NORMS[norm],
        NORM_ROW=0 if norm is None else norm_row(k_cols),
        EVEN_K=k_cols % block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        TILE_N=block_n * (1 if gate is None else 2),
        PDL=pdl,
        num_warps=NUM_WARPS,
        launch_pdl=pdl,
    )
    return out.reshape(*x.shape[:-1], n_rows)


def _check_row(name: str, tensor: torch.Tensor | None, size: int, dtype: torch.dtype) -> None:
    if tensor is not None and (tensor.numel() != size or tensor.dtype != dtype):
        raise ValueError(f"{name} must hold {size} values of {dtype}")


@gemv.register_fake
def _(x, weight, *args, **kwargs):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through :func:`gemv` where it :func:`serves` (the backend's one-row
    product)."""
    if serves(x, weight) and (bias is None or bias.dtype == x.dtype):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gemv` computes ``F.linear(x, weight)``: one row, floating point, the
    weight's rows contiguous (a view of a joined buffer is)."""
    return (
        x.numel() == x.shape[-1]
        and x.dtype == weight.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.is_floating_point()
    )
