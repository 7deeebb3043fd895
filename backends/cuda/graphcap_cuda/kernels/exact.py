"""Trainer-exact operations on CUDA: Triton kernels whose sums run in an order fixed by the row
and by the key's position, never by the number of rows (docs/decisions.md, decision 90).

A rollout's decode step multiplies as many rows as are live, the trainer's forward batch x
sequence rows; cuBLAS and torch's reductions pick their kernel (split-K, split reductions, tile
shapes) from those sizes, so a row's result changes in the last bits with its company. Each
kernel here has one launch configuration, whatever the number of rows:

- :func:`linear`: no autotuning; every output tile sums over K in ``BLOCK_K`` steps in order,
  accumulating in float32, and stores the input dtype. A narrow, deep weight sums K in
  splits fixed by its shape (:func:`splits`), each from zero, added in split order: by a
  program per split at few rows (a decode step, whose narrow products would otherwise keep
  few multiprocessors busy), by one program in turn at many. The tile is
  :data:`LINEAR_BLOCKS`, or :data:`LARGE_LINEAR_BLOCKS` for a trainer's batch: the same
  ``BLOCK_K``, and the same bits (measured; the device tests check). A row's output is the
  same bits at M=1 and M=16384.
- :func:`attention`: each query's keys in blocks of :data:`ATTENTION_BLOCK_N` whose boundaries
  are fixed by key *position* (the column of the row's position 0 is the block origin), so a
  left-padded trainer batch, a right-padded one, the rollout's left-padded cache and caches of
  any length give the same blocks; an online softmax over the blocks in position order, masked
  keys exact zeros, grouped-query heads read unrepeated, a sliding window through the mask.
  A tile has :data:`ATTENTION_BLOCK_M` rows: a head's queries in the trainer's forward and a
  prefill; in a decode step (one query a row) the query's heads that share a K/V head, so the
  step reads each K/V head once, not once per query head (the rows are padded to the tile).
  Either way the decode step and the trainer's causal forward run the same matrix shapes, and
  a row's arithmetic does not depend on which rows sit beside it in the tile (the MMA
  property the padded decode tile already relied on; the device test checks it). Requires
  the row's attended keys at consecutive columns in position order: true of a trainer's
  batch padded on either side and of graphcap's caches.
- :func:`rms_norm`: one program per row; :func:`log_softmax`: a program per row and chunk of
  columns, the chunks' statistics combined in one fixed way (chunks fixed by column).

Each is differentiable: the backward is torch's (matrix products, SDPA's fused backward of
the same attention, torch's log_softmax backward, the norm's formula), which needs only agree
within the dtype's tolerance. The mask's analysis (attended keys, origins, reaches) runs once
a forward (:func:`graphcap.exact_ops.per_forward`), not once a layer. No host value depends
on the data, so the forwards capture in a CUDA graph.

Costs (decision 92): the SDPA backward, the fused ``log_softmax`` backward, the decode tile of
a K/V head's query heads and the once-a-forward mask analysis were changed by reading the code,
after an H100 run measured 2.73x the default rollout and 2.10x the default trainer step;
**their speed is unmeasured until the next device run**
(``benchmarks/exact_kernels_h200.py``).
The product's tile is unchanged until that script's ``tiles`` part says which tiles pay and
whether they give the same bits.

The trainer must not ``torch.compile`` a model under ``trainer_exact``: fusion rounds
differently on one side. With ``TRITON_INTERPRET=1`` set before import they run on CPU tensors
(tests).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from graphcap.exact_ops import ExactOps, attended_keys, per_forward
from graphcap_cuda.kernels import exact_pointwise, launch

#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of a product's launch at few rows.
LINEAR_BLOCKS = (64, 64, 64, 4, 3)
#: The tile of a launch of at least :data:`LARGE_TILE_ROWS` rows (a trainer's batch, a long
#: prefill) that is not spread over splits: ``BLOCK_K`` as :data:`LINEAR_BLOCKS`'. Every tile
#: shape tried gave the same bits on an H100 (the MMA sums each 16 of K in order, whatever the
#: tile), and 128 x 128 took 0.55-0.69x the small tile's time at 16,384 rows
#: (``benchmarks/exact_kernels_h200.py``'s ``tiles``; the device tests check the bits).
LARGE_LINEAR_BLOCKS = (128, 128, 64, 8, 3)
assert LARGE_LINEAR_BLOCKS[2] == LINEAR_BLOCKS[2], "splits are whole blocks of both tiles' K"
LARGE_TILE_ROWS = 1024
#: Programs a product's launch should have at one row tile: a weight with fewer column tiles
#: sums over K in splits (:func:`splits`), fixed by its shape, enough to come near this.
LINEAR_PROGRAMS = 256
#: The fewest ``BLOCK_K`` blocks of a split, so that each program's loop still pipelines.
LINEAR_SPLIT_BLOCKS = 4
#: A launch of fewer output tiles runs a program per tile and split; a larger one (a trainer's
#: batch) a program per tile that sums its splits in turn. Either gives the same bits.
SPREAD_BELOW_TILES = LINEAR_PROGRAMS
#: Queries per attention program (a decode step's single query is padded to it).
ATTENTION_BLOCK_M = 64
#: Keys per attention block: block ``j`` holds the row's key positions ``[j*N, (j+1)*N)``.
ATTENTION_BLOCK_N = 64
ATTENTION_WARPS = 4
#: Columns of a chunk of ``log_softmax``'s row: a program per row and chunk, the chunks'
#: maxima and sums combined in one fixed way (a program per row walking 128,256 columns in
#: series took 88 us of a 64-row decode step on an H100).
SOFTMAX_BLOCK = 4096


def _precision(dtype: torch.dtype) -> str | None:
    """Float32 products in full precision (TF32 would round the inputs); others as they come."""
    return "ieee" if dtype == torch.float32 else None


@triton.jit
def _k_block(
    acc, x_ptr, w_ptr, rm, rn, rows, cols, at, stop, stride_x, stride_w,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``acc`` plus the tile's product over K in ``[at, at + BLOCK_K)``, columns from ``stop``
    on read as zeros."""
    k = at + tl.arange(0, BLOCK_K)
    a = tl.load(
        x_ptr + rm[:, None] * stride_x + k[None, :],
        mask=(rm[:, None] < rows) & (k[None, :] < stop),
        other=0.0,
    )
    b = tl.load(
        w_ptr + rn[None, :] * stride_w + k[:, None],
        mask=(rn[None, :] < cols) & (k[:, None] < stop),
        other=0.0,
    )
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _split_sum(
    x_ptr, w_ptr, rm, rn, rows, cols, start, stop, stride_x, stride_w,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One split's float32 sum of a tile over K in ``[start, stop)``, ``BLOCK_K`` at a time in
    order, from zero."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for at in range(start, stop, BLOCK_K):
        acc = _k_block(acc, x_ptr, w_ptr, rm, rn, rows, cols, at, stop, stride_x, stride_w,
                       BLOCK_K, PRECISION)  # fmt: skip
    return acc


@triton.jit(do_not_specialize=["rows"])
def _linear(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    rows,
    cols,
    depth,
    span,
    plane,
    stride_x,
    stride_w,
    stride_out,
    SPLITS: tl.constexpr,
    SPREAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # programs in groups of GROUP_M row tiles per column tile, for the cache's reuse of both
    # operands; which program computes a tile changes nothing in it
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(rows, BLOCK_M)
    col_tiles = tl.cdiv(cols, BLOCK_N)
    per_group = GROUP_M * col_tiles
    first = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(row_tiles - first, GROUP_M)
    tile_m = first + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    rm = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rm[:, None] < rows) & (rn[None, :] < cols)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SPREAD:
        # a program per tile and split: each stores its split's sum; the last to arrive adds
        # them in split order, as one program does below, and resets the count for the next
        # launch (so a captured step needs no zeroing)
        split = tl.program_id(1)
        start = split * span
        acc = _split_sum(
            x_ptr, w_ptr, rm, rn, rows, cols, start, tl.minimum(start + span, depth),
            stride_x, stride_w, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
        )  # fmt: skip
        cell = rm[:, None] * cols + rn[None, :]
        tl.store(part_ptr + split * plane + cell, acc, mask=inside)
        tl.debug_barrier()
        tile = tile_m * col_tiles + tile_n
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLITS - 1:
            for s in range(SPLITS):
                total += tl.load(part_ptr + s * plane + cell, mask=inside, other=0.0)
            tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :],
                     total.to(out_ptr.dtype.element_ty), mask=inside)  # fmt: skip
            tl.store(count_ptr + tile, 0)
    else:
        # one loop over all of K, each split's sum added to the total at the split's end (a
        # loop per split would fill and drain the loads' pipeline once a split)
        per_split = span // BLOCK_K
        last = tl.cdiv(depth, BLOCK_K) - 1
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for block in range(0, last + 1):
            acc = _k_block(acc, x_ptr, w_ptr, rm, rn, rows, cols, block * BLOCK_K, depth,
                           stride_x, stride_w, BLOCK_K, PRECISION)  # fmt: skip
            if (block % per_split == per_split - 1) | (block == last):
                total += acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :],
                 total.to(out_ptr.dtype.element_ty), mask=inside)  # fmt: skip


def splits(cols: int, depth: int) -> tuple[int, int]:
    """(splits, columns of K each): how a product with this weight sums over K, from the
    weight's shape alone. A decode step multiplies few rows, so a narrow weight (q, k, v, o,
    down) gives a launch of one program per tile too few programs to keep the device busy,
    each walking all of K; the sum is cut into splits of whole ``BLOCK_K`` blocks, summed each
    from zero and then added in split order, whoever computes them."""
    _, block_n, block_k, _, _ = LINEAR_BLOCKS
    blocks = triton.cdiv(depth, block_k)
    wanted = max(1, LINEAR_PROGRAMS // triton.cdiv(cols, block_n))
    count = max(1, min(wanted, blocks // LINEAR_SPLIT_BLOCKS))
    span = max(1, triton.cdiv(blocks, count)) * block_k
    return max(1, triton.cdiv(depth, span)), span  # K = 0: one split of nothing


def _launch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(x.shape[:-1].numel(), x.shape[-1])  # K may be 0
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    count, depth = rows.shape
    cols = weight.shape[0]
    out = torch.empty((count, cols), dtype=x.dtype, device=x.device)
    parts, span = splits(cols, depth)
    tiles = triton.cdiv(count, LINEAR_BLOCKS[0]) * triton.cdiv(cols, LINEAR_BLOCKS[1])
    # who computes a split changes no bit (splits()), nor does the tile's shape with BLOCK_K
    # kept (measured), so the launch may follow the rows: few tiles (a decode step) get a
    # program per split, many rows (a trainer's batch) the large tile, a program per tile
    spread = parts > 1 and tiles < SPREAD_BELOW_TILES
    large = not spread and count >= LARGE_TILE_ROWS
    block_m, block_n, block_k, warps, stages = LARGE_LINEAR_BLOCKS if large else LINEAR_BLOCKS
    tiles = triton.cdiv(count, block_m) * triton.cdiv(cols, block_n)
    if spread:
        part = torch.empty((parts, count, cols), dtype=torch.float32, device=x.device)
        counts = launch.arrival_counts(x.device, tiles)
    else:
        part = counts = out  # not read
    if count:
        _linear[(tiles, parts if spread else 1)](
            rows,
            weight,
            out,
            part,
            counts,
            count,
            cols,
            depth,
            span,
            count * cols,  # a split's plane of the partial sums
            rows.stride(0),
            weight.stride(0),
            out.stride(0),
            SPLITS=parts,
            SPREAD=spread,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            GROUP_M=8,
            PRECISION=_precision(x.dtype),
            num_warps=warps,
            num_stages=stages,
        )
    return out.reshape(*x.shape[:-1], cols)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _launch_linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the one-configuration kernel; the bias is added
    after the product, elementwise."""
    if x.dtype != weight.dtype:
        raise TypeError(
            f"trainer-exact linear: input {x.dtype} and weight {weight.dtype} differ (autocast?): "
            "trainer-exact forwards run in the weights' dtype, as the rollout does; give the "
            "model its weights in the dtype to train in and run it without autocast"
        )
    out = _Linear.apply(x, weight)
    return out if bias is None else out + bias


@triton.jit(do_not_specialize=["queries", "keys"])
def _ordered_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    allowed_ptr,
    anchor_ptr,
    reach_ptr,
    out_ptr,
    heads,
    groups,
    queries,
    keys,
    sq_b,
    sq_h,
    sq_q,
    sk_b,
    sk_h,
    sk_s,
    sv_b,
    sv_h,
    sv_s,
    sa_b,
    sa_q,
    sa_s,
    so_b,
    so_q,
    so_h,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # a tile row is a (query, head): BLOCK_M queries of one head, or (GROUPED, one query a
    # row: a decode step) the query's heads that share one K/V head, so that K/V is read once
    # for the group; each row's arithmetic is the same either way
    lane = tl.arange(0, BLOCK_M)
    if GROUPED:
        b = (tl.program_id(0) // (heads // groups)).to(tl.int64)
        kv = tl.program_id(0) % (heads // groups)
        h = (kv * groups + lane)[:, None]
        rows = lane * 0
        live = lane < groups
    else:
        b = (tl.program_id(0) // heads).to(tl.int64)
        h = tl.program_id(0) % heads
        kv = h // groups
        rows = tl.program_id(1) * BLOCK_M + lane
        live = rows < queries
    d = tl.arange(0, BLOCK_D)
    dims = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_q + d[None, :],
        mask=live[:, None] & dims[None, :],
        other=0.0,
    )
    reach = tl.load(reach_ptr + b * queries + rows, mask=live, other=-1)
    blocks = (tl.max(reach, axis=0) + BLOCK_N) // BLOCK_N
    anchor = tl.load(anchor_ptr + b)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(0, blocks):
        cols = anchor + j * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = (cols >= 0) & (cols < keys)
        kv_mask = inside[:, None] & dims[None, :]
        k = tl.load(
            k_ptr + b * sk_b + kv * sk_h + cols[:, None] * sk_s + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_ptr + b * sv_b + kv * sv_h + cols[:, None] * sv_s + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        ok = tl.load(
            allowed_ptr + b * sa_b + rows[:, None] * sa_q + cols[None, :] * sa_s,
            mask=live[:, None] & inside[None, :],
            other=0,
        )
        s = tl.where(ok != 0, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # exactly 1 where the maximum stays: a block of masked keys leaves the sums as they were
        alpha = tl.where(m_new == m_i, 1.0, tl.exp(m_i - m_safe))
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + b * so_b + rows[:, None] * so_q + h * so_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=live[:, None] & dims[None, :],
    )


def row_origin(
    allowed: torch.Tensor, position_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block origin (the column of its position 0) and each query's reach (the
    position of the last key it attends, -1 for none), from ``allowed`` (B, Q, S).

    The origin comes from the row's latest real query: the first query attending the row's
    last attended column (its own column, causal attention attends itself; a right-padded
    trainer batch's padding queries come after it) minus its position. ``position_ids``
    (1 or B, Q), else the count of keys it attends minus one (right without a window).
    Device math only: no host read, so it captures."""
    batch, queries, keys = allowed.shape
    columns = torch.arange(keys, device=allowed.device)
    last = torch.where(allowed, columns, -1).amax(-1)  # (B, Q)
    top = last.amax(-1, keepdim=True)
    latest = (last == top).to(torch.int8).argmax(-1, keepdim=True)
    if position_ids is not None:
        position = position_ids.to(torch.long).expand(batch, queries).gather(-1, latest)
    else:
        position = allowed.gather(1, latest[:, :, None].expand(-1, -1, keys)).sum(-1) - 1
    origin = (top - position).clamp(min=0)  # a row with no keys at all reads nothing
    reach = torch.where(last >= 0, last - origin, -1)
    return origin.reshape(batch).to(torch.int32), reach.to(torch.int32).contiguous()


def _launch_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    origin: torch.Tensor,
    reach: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    batch, heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = torch.empty((batch, queries, heads, head_dim), dtype=query.dtype, device=query.device)
    flags = allowed.view(torch.uint8)
    groups = heads // kv_heads
    grouped = queries == 1 and 1 < groups <= ATTENTION_BLOCK_M
    if batch and queries:
        if grouped:
            grid = (batch * kv_heads, 1)
        else:
            grid = (batch * heads, triton.cdiv(queries, ATTENTION_BLOCK_M))
        _ordered_attention[grid](
            query,
            key,
            value,
            flags,
            origin,
            reach,
            out,
            heads,
            groups,
            queries,
            keys,
            *query.stride()[:3],
            *key.stride()[:3],
            *value.stride()[:3],
            *flags.stride(),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            scale,
            HEAD_DIM=head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_M=ATTENTION_BLOCK_M,
            BLOCK_N=ATTENTION_BLOCK_N,
            GROUPED=grouped,
            PRECISION=_precision(query.dtype),
            num_warps=ATTENTION_WARPS,
        )
    return out


def softmax_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain softmax attention in float32 (the tests' reference): ``allowed`` (B, Q, S);
    returns (B, Q, H, D) in the query's dtype."""
    groups = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(groups, dim=1)
    v = value.float().repeat_interleave(groups, dim=1)
    scores = (query.float() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query of no keys: zeros
    return (weights @ v).transpose(1, 2).to(query.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        allowed: torch.Tensor,
        origin: torch.Tensor,
        reach: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        ctx.save_for_backward(query, key, value, allowed)
        ctx.scale = scale
        return _launch_attention(query, key, value, allowed, origin, reach, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """SDPA's backward of the same attention, as the models' default SDPA forward runs it
        (K/V repeated per head, the mask given): a fused kernel in the inputs' dtype that
        never holds the (B, H, Q, S) scores; gradients need only the dtype's tolerance. A
        query that attends no key output zeros, a constant: it attends every key here (SDPA
        would give NaN) and its gradient is zeroed, so it adds exact zeros to K and V's."""
        query, key, value, allowed = ctx.saved_tensors
        has_keys = allowed.any(-1, keepdim=True)  # (B, Q, 1)
        opened = allowed | ~has_keys
        grad = grad.masked_fill(~has_keys[..., None], 0.0)
        groups = query.shape[1] // key.shape[1]
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (query, key, value)]
            q, k, v = inputs
            out = F.scaled_dot_product_attention(
                q,
                k.repeat_interleave(groups, dim=1),
                v.repeat_interleave(groups, dim=1),
                attn_mask=opened[:, None],
                scale=ctx.scale,
            ).transpose(1, 2)
            grads = torch.autograd.grad(out, inputs, grad)
        return (*grads, None, None, None, None)


def _mask_analysis(
    attention_mask: torch.Tensor | None,
    positions: torch.Tensor | None,
    batch: int,
    queries: int,
    keys: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, Q, S) attended keys, each row's origin and each query's reach (:func:`row_origin`):
    the same for every layer given the same mask, so computed once a forward."""
    allowed = attended_keys(attention_mask, queries, keys, device)
    if allowed.dim() == 4:
        if allowed.shape[1] != 1:
            raise ValueError("trainer-exact attention takes one mask for all heads")
        allowed = allowed[:, 0]
    allowed = allowed.expand(batch, queries, keys)
    return allowed, *row_origin(allowed, positions)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (module docstring): ``query`` (B, H, Q, D),
    ``key``/``value`` (B, Hkv, S, D), the 4-D mask (bool or additive) or ``None`` (causal);
    returns (B, Q, H, D) in the query's dtype. Reads ``position_ids`` from ``kwargs`` where
    the model passes them (the covered families do)."""
    if dropout:
        raise ValueError("trainer-exact attention takes no dropout (set attention_dropout=0)")
    batch, _, queries, head_dim = query.shape
    keys = key.shape[2]
    positions = kwargs.get("position_ids")
    allowed, origin, reach = per_forward(
        (attention_mask, positions),
        (batch, queries, keys, str(query.device)),
        lambda: _mask_analysis(attention_mask, positions, batch, queries, keys, query.device),
    )
    scale = scaling if scaling is not None else head_dim**-0.5
    return _Attention.apply(query, key, value, allowed, origin, reach, scale), None


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, width, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / width
    scaled = (x * tl.div_rn(1.0, tl.sqrt_rn(variance + eps))).to(x_ptr.dtype.element_ty)
    weight = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    out = weight * scaled.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def _norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The covered families' RMSNorm, as transformers writes it."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        width = rows.shape[1]
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
        out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
        block = triton.next_power_of_2(width)
        if rows.shape[0]:
            _rms_norm[(rows.shape[0],)](
                rows,
                weight,
                out,
                width,
                rows.stride(0),
                out.stride(0),
                eps,
                BLOCK=block,
                num_warps=min(16, max(1, block // 256)),
            )
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_(), weight.detach().requires_grad_()]
            out = _norm_reference(*inputs, ctx.eps)
            grads = torch.autograd.grad(out, inputs, grad)
        return (*grads, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, one program per row."""
    return _RMSNorm.apply(x, weight, eps)


@triton.jit
def _softmax_chunks(x_ptr, stat_ptr, width, chunks, stride_x, BLOCK: tl.constexpr):
    # a program per (row, chunk of BLOCK columns): the chunk's maximum and its sum of
    # exp(x - maximum), an empty or all -inf chunk (0, -inf)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=float("-inf"))
    top = tl.max(x, axis=0)
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(x - safe), axis=0)
    at = stat_ptr + (row * chunks + chunk) * 2
    tl.store(at, top)
    tl.store(at + 1, total)


@triton.jit
def _softmax_write(
    x_ptr, stat_ptr, out_ptr, width, chunks, stride_x, stride_out,
    BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    # every chunk's program combines its row's chunk statistics the same way (the same
    # values, the same reduction), then writes its columns: (x - max) - log(sum)
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, CHUNKS)
    at = stat_ptr + (row * chunks + lane) * 2
    tops = tl.load(at, mask=lane < chunks, other=float("-inf"))
    sums = tl.load(at + 1, mask=lane < chunks, other=0.0)
    largest = tl.max(tops, axis=0)
    scale = tl.where(tops == float("-inf"), 0.0, tl.exp(tops - largest))
    log_total = tl.log(tl.sum(sums * scale, axis=0))
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, (x - largest) - log_total, mask=cols < width)


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
        count, width = rows.shape
        block = SOFTMAX_BLOCK  # by column only: a row's chunks whatever its company
        chunks = triton.cdiv(width, block)
        if count and width:
            stats = torch.empty((count, chunks, 2), dtype=torch.float32, device=x.device)
            grid = (count, chunks)
            _softmax_chunks[grid](
                rows, stats, width, chunks, rows.stride(0), BLOCK=block, num_warps=8
            )
            _softmax_write[grid](
                rows, stats, out, width, chunks, rows.stride(0), out.stride(0),
                BLOCK=block, CHUNKS=triton.next_power_of_2(chunks), num_warps=8,
            )  # fmt: skip
        out = out.reshape(x.shape)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        # torch's own log_softmax backward, grad - exp(out) * sum(grad), as one fused pass
        # (the formula in four torch ops read and wrote the vocabulary-wide tensor ~9 times)
        (out,) = ctx.saved_tensors
        return torch.ops.aten._log_softmax_backward_data(grad, out, -1, out.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dimension of float32 ``x``, in chunks of columns."""
    if x.dtype != torch.float32:
        raise TypeError(f"trainer-exact log_softmax takes float32 scores, not {x.dtype}")
    return _LogSoftmax.apply(x)


#: What :meth:`graphcap_cuda.backend.CUDABackend.exact_ops` offers. SiLU alone stays torch's (a
#: CUDA elementwise kernel applies one functor to every element, vectorised or not); the MLP's
#: SiLU and product, and the rotary embedding, are one kernel each (:mod:`.exact_pointwise`).
OPS = ExactOps(
    linear=linear,
    attention=attention,
    rms_norm=rms_norm,
    log_softmax=log_softmax,
    rotary=exact_pointwise.rotary,
    silu_mul=exact_pointwise.silu_mul,
)
