"""Trainer-exact elementwise work of a decoder layer in one kernel each, rounding as the model's
own operations round (docs/decisions.md, decision 95).

Uncompiled, the covered families' rotary embedding is ten kernels a layer (a product, a
negation, a concatenation, a product and a sum, for q and for k) and their MLP's activation
two (SiLU, then the product with ``up``); in a captured decode step each is a launch and a
pass over memory, which is most of what a trainer-exact step pays over a compiled one. Each
kernel here does the same arithmetic in one pass and rounds to the tensor's dtype wherever
torch's operation would store its result, so its bits are the model's own where the device's
arithmetic is torch's: products and sums in float32, exactly rounded and never fused into
FMAs (``enable_fp_fusion=False``); SiLU as ``x / (1 + exp(-x))`` in float32 with the CUDA
math library's ``expf`` and an exactly rounded division, as torch's SiLU kernel computes it.
The device test checks the bits against torch's operations. Both sides of a trainer-exact
forward run these kernels, so the rollout and the trainer agree whatever the answer.

Each is differentiable through torch's own formula (gradients need only the dtype's
tolerance). With ``TRITON_INTERPRET=1`` they run on CPU tensors (tests), ``exp`` then NumPy's.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

#: Under Triton's interpreter no CUDA math library: NumPy's ``exp`` (the tests' CPU runs).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: Elements of a flattened tensor a SiLU-product program handles.
SILU_BLOCK = 1024


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The covered families' ``rotate_half``: (-second half, first half)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The covered families' ``apply_rotary_pos_emb`` (``unsqueeze_dim=1``), in torch."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@triton.jit
def _rotate(
    x_ptr, out_ptr, b, s, heads, sx_b, sx_h, sx_s, so_b, so_h, so_s, c, sn,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One position's heads of one tensor: ``x * cos + rotate_half(x) * sin``, each product
    and the sum rounded to the dtype, as three torch operations store them."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    half: tl.constexpr = HEAD_DIM // 2
    inside = (h < heads) & (d < HEAD_DIM)
    base = x_ptr + b * sx_b + s * sx_s + h * sx_h
    x = tl.load(base + d, mask=inside, other=0.0)
    partner = tl.load(base + (d + half) % HEAD_DIM, mask=inside, other=0.0)
    rotated = tl.where(d < half, -partner, partner)  # a negation is exact
    dtype = x.dtype
    first = (x.to(tl.float32) * c).to(dtype)
    second = (rotated.to(tl.float32) * sn).to(dtype)
    out = (first.to(tl.float32) + second.to(tl.float32)).to(dtype)
    tl.store(out_ptr + b * so_b + s * so_s + h * so_h + d, out, mask=inside)


@triton.jit
def _rotary(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, positions, q_heads, k_heads,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sc_b, sc_s, ss_b, ss_s,
    sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s,
    HEAD_DIM: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    # a program per (row, position): its cos and sin read once for q's and k's heads
    b = (tl.program_id(0) // positions).to(tl.int64)
    s = (tl.program_id(0) % positions).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    c = tl.load(cos_ptr + b * sc_b + s * sc_s + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + b * ss_b + s * ss_s + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    _rotate(q_ptr, qo_ptr, b, s, q_heads, sq_b, sq_h, sq_s, sqo_b, sqo_h, sqo_s, c, sn,
            HEAD_DIM, BLOCK_QH, BLOCK_D)  # fmt: skip
    _rotate(k_ptr, ko_ptr, b, s, k_heads, sk_b, sk_h, sk_s, sko_b, sko_h, sko_s, c, sn,
            HEAD_DIM, BLOCK_KH, BLOCK_D)  # fmt: skip


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(q, k, cos, sin)
        batch, q_heads, positions, head_dim = q.shape
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        cos_b, sin_b = (t.expand(batch, positions, head_dim) for t in (cos, sin))
        if q.numel() and k.numel():
            _rotary[(batch * positions,)](
                q, k, cos_b, sin_b, q_out, k_out, positions, q_heads, k.shape[1],
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                cos_b.stride(0), cos_b.stride(1), sin_b.stride(0), sin_b.stride(1),
                q_out.stride(0), q_out.stride(1), q_out.stride(2),
                k_out.stride(0), k_out.stride(1), k_out.stride(2),
                HEAD_DIM=head_dim,
                BLOCK_QH=triton.next_power_of_2(q_heads),
                BLOCK_KH=triton.next_power_of_2(k.shape[1]),
                BLOCK_D=triton.next_power_of_2(head_dim),
                enable_fp_fusion=False,
            )  # fmt: skip
        return q_out, k_out

    @staticmethod
    def backward(ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor) -> tuple:
        needs = ctx.needs_input_grad
        inputs = [
            t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, needs, strict=True)
        ]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            outs = rotary_reference(*inputs)
            grads = iter(torch.autograd.grad(outs, wanted, (grad_q, grad_k)))
        return tuple(next(grads) if t.requires_grad else None for t in inputs)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The covered families' ``apply_rotary_pos_emb(q, k, cos, sin)`` in one kernel: ``q``
    (B, H, S, D), ``k`` (B, Hkv, S, D), ``cos``/``sin`` (B or 1, S, D), all of one dtype and
    unit stride in the last dimension; anything else through :func:`rotary_reference` (the
    same bits, more launches)."""
    tensors = (q, k, cos, sin)
    if (
        q.dim() != 4
        or k.dim() != 4
        or cos.dim() != 3
        or cos.shape != sin.shape
        or k.shape[0] != q.shape[0]
        or k.shape[2:] != q.shape[2:]
        or cos.shape[1:] != q.shape[2:]
        or cos.shape[0] not in (1, q.shape[0])
        or q.shape[-1] % 2
        or any(t.dtype != q.dtype or t.device != q.device or t.stride(-1) != 1 for t in tensors)
    ):
        return rotary_reference(q, k, cos, sin)
    return _Rotary.apply(q, k, cos, sin)


@triton.jit
def _silu_mul(gate_ptr, up_ptr, out_ptr, count, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = at < count
    gate = tl.load(gate_ptr + at, mask=inside, other=0.0)
    up = tl.load(up_ptr + at, mask=inside, other=0.0)
    x = gate.to(tl.float32)
    e = libdevice.exp(-x) if LIBDEVICE else tl.exp(-x)  # the CUDA math library's expf
    act = tl.div_rn(x, 1.0 + e).to(gate.dtype)  # torch's SiLU stores its result
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + at, out, mask=inside)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The covered families' MLP activation: ``silu(gate) * up``, in torch."""
    return torch.nn.functional.silu(gate) * up


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        gate_c, up_c = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate_c)
        count = out.numel()
        if count:
            _silu_mul[(triton.cdiv(count, SILU_BLOCK),)](
                gate_c,
                up_c,
                out,
                count,
                BLOCK=SILU_BLOCK,
                LIBDEVICE=not _INTERPRETED,
                enable_fp_fusion=False,
            )
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            return torch.autograd.grad(silu_mul_reference(*inputs), inputs, grad)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one kernel, rounded as the two torch operations round."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        return silu_mul_reference(gate, up)
    return _SiluMul.apply(gate, up)
