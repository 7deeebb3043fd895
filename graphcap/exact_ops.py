"""Trainer-exact operations: what a backend offers so a rollout's log-probs are the trainer's.

A trainer-exact forward (:func:`graphcap.rollout.trainer_exact`) runs every reduction of the
model in an order fixed by the row and by the key's position alone, so the rollout's decode
step, its prefill and the trainer's full-sequence forward compute a token's log-prob as the
same bits (docs/decisions.md, decisions 85 and 90). Which kernels achieve that is the device's
business: a backend offers them as one :class:`ExactOps` (:meth:`Backend.exact_ops
<graphcap.backend.Backend.exact_ops>`). The CPU reference backend offers the functions of
this module, which rely on orders measured on the CPU (the BLAS per tile shape, torch's
sequential ``cumsum``); a device plugin writes its own kernels against the same contract.

This module is core: plugins import :class:`ExactOps`, :func:`attended_keys` and
:func:`per_forward`; it names no device library.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

#: Rows per product tile of the CPU reference: every linear layer multiplies ``ROW_TILE`` rows.
ROW_TILE = 16

T = TypeVar("T")
#: What :func:`per_forward` keeps for the model forward running now (``None`` outside one).
_FORWARD_MEMO: ContextVar[dict[Hashable, tuple[tuple[object, ...], Any]] | None] = ContextVar(
    "graphcap_exact_forward_memo", default=None
)


@dataclass(frozen=True)
class ExactOps:
    """A backend's trainer-exact operations. Each must give a row (a query) the same bits
    whatever the other rows, their number, the row's padding or where it sits, and must be
    differentiable (a trainer's loss backpropagates through them; gradients need only agree
    within the dtype's tolerance). ``None`` keeps the model's own operation where the
    backend has measured it row-invariant.

    - ``linear(x, weight, bias)``: ``F.linear``; the sum over K in an order independent of
      the number of rows (every ``nn.Linear``, ``lm_head`` included).
    - ``attention``: a transformers attention function (``(module, query, key, value,
      attention_mask, dropout, scaling, **kwargs) -> (out (B, Q, H, D), None)``) whose sums
      over keys run in key-position order, masked keys adding exact zeros, identically for a
      decode query reading the cache and the same position in a full causal forward.
    - ``silu(x)``: the MLP's activation, elementwise in the same rounding everywhere.
    - ``rms_norm(x, weight, eps)``: the models' RMSNorm (``weight * (x * rsqrt(mean(x^2) +
      eps)).to(x.dtype)``), one row at a time.
    - ``log_softmax(x)``: over the last dimension of float32 ``x``, one row at a time (the
      rollout's recorded log-probs and :func:`graphcap.rollout.token_logprobs`).
    - ``rotary(q, k, cos, sin)``: the models' ``apply_rotary_pos_emb`` (``unsqueeze_dim=1``),
      and ``silu_mul(gate, up)``: their MLP's ``act_fn(gate) * up``, each fewer launches
      than the model's own operations (elementwise, so row-invariant either way).
    """

    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    attention: Callable[..., tuple[torch.Tensor, None]]
    silu: Callable[[torch.Tensor], torch.Tensor] | None = None
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    log_softmax: Callable[[torch.Tensor], torch.Tensor] | None = None
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


@contextlib.contextmanager
def forward_scope() -> Iterator[None]:
    """One model forward under ``trainer_exact``: what :func:`per_forward` keeps lives until
    the block ends (:func:`graphcap.rollout.trainer_exact` wraps the model's forward in it)."""
    token = _FORWARD_MEMO.set({})
    try:
        yield
    finally:
        _FORWARD_MEMO.reset(token)


def per_forward(objects: tuple[object, ...], details: Hashable, compute: Callable[[], T]) -> T:
    """``compute()`` once per model forward for the same ``objects`` (compared by identity,
    held until the forward ends) and ``details``: the layers of one forward share what they
    derive from the mask and positions they are all given, so a captured decode step runs
    that derivation once, not once a layer. Device work only, recorded where the first layer
    records it (the same capture). Outside a :func:`forward_scope` (a checkpointed layer's
    recomputation in backward), computes every time."""
    memo = _FORWARD_MEMO.get()
    if memo is None:
        return compute()
    key = (*(id(o) for o in objects), details)  # unique: the memo holds the objects
    if key not in memo:
        memo[key] = (objects, compute())
    return memo[key][1]


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` whose every row goes through one ``(ROW_TILE, K)`` product, zero-padded.

    A BLAS picks its kernel (and so the order of the sum over K) from the number of rows: on
    the CPU a one-row fp32 product differs from a many-row one in the last bit. A fixed tile
    shape fixes the kernel; a row's result does not depend on the other rows of its tile. The
    bias is added after the product, elementwise."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    pad = -count % ROW_TILE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[-1])])
    out = torch.cat([F.linear(tile, weight) for tile in rows.split(ROW_TILE)])[:count]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def exact_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU from operations that round the same wherever an element sits in the tensor."""
    return x / (1 + torch.exp(-x))


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over ``dim`` in index order, accumulated in double: the last element of torch's
    CPU cumulative sum, a sequential loop per output (decision 85). Exact zeros anywhere in the
    dimension leave the result unchanged, so padding columns cost nothing but time."""
    return x.cumsum(dim).select(dim, -1)


def attended_keys(
    attention_mask: torch.Tensor | None, queries: int, keys: int, device: torch.device
) -> torch.Tensor:
    """Which key columns each query attends, as a bool tensor broadcastable to
    ``(B, H, queries, keys)``: the 4-D mask the model was given (bool, or additive with 0 for
    attended), or causal when it was given none."""
    if attention_mask is None:
        query_columns = torch.arange(keys - queries, keys, device=device)
        return torch.arange(keys, device=device)[None, :] <= query_columns[:, None]
    mask = attention_mask[..., -queries:, :keys]
    return mask if mask.dtype == torch.bool else mask == 0


def exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention whose every sum runs over the key columns in order, in float32 products and
    double running sums (:func:`ordered_sum`), masked keys adding exact zeros.

    Keys are in position order in a trainer's batch and in the rollout's cache alike (padding
    and unused columns are masked), so a query's result depends on its own keys only, not on
    where they sit, how many columns surround them or the batch. A sliding window arrives in
    the mask (transformers' and graphcap's alike). ``query`` (B, H, Q, D), ``key``/``value``
    (B, Hkv, S, D); returns (B, Q, H, D) in the query's dtype."""
    if dropout:
        raise ValueError("trainer-exact attention takes no dropout (set attention_dropout=0)")
    groups = query.shape[1] // key.shape[1]
    q = query.float()
    k = key.float().repeat_interleave(groups, dim=1)
    v = value.float().repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    allowed = attended_keys(attention_mask, q.shape[2], k.shape[2], q.device)
    scores = ordered_sum(q[:, :, :, None, :] * k[:, :, None, :, :], -1) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a query of no keys
    weights = torch.exp(scores - top)
    total = ordered_sum(weights, -1)[..., None]
    out = ordered_sum(weights[..., None] * v[:, :, None], -2)
    out = out / torch.where(total > 0, total, torch.ones_like(total))
    return out.transpose(1, 2).contiguous().to(query.dtype), None


#: The CPU reference backend's operations. RMSNorm and ``log_softmax`` are the model's and
#: torch's own: measured row-invariant on the CPU (decision 85).
REFERENCE = ExactOps(linear=tiled_linear, attention=exact_attention, silu=exact_silu)
