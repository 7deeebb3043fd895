"""Split-KV decode attention in Triton: grouped-query K/V read as they are, and only the cache
blocks the mask lets a row attend to.

A decode step's query is one token per row; the static cache holds every column the rollout
will ever write. This kernel splits each row's columns into chunks (enough programs to fill the
device even at batch 1), and each program walks its chunk in blocks of ``BLOCK_N`` columns: it
reads the block's mask first and skips the block's K/V when no column of it may be attended
(unwritten columns, left padding, outside a sliding window). The per-row lengths thus live on
the device, in the mask the engine updates each step, so one captured graph serves every step.
All query heads that share a K/V head are computed together from one read of that head.

A second kernel combines the chunks' partial softmaxes. Accumulation is fp32; fp32 inputs use
IEEE (not TF32) products so fp32 results match SDPA to rounding. A row with no column to attend
gets zeros (SDPA would average V; such rows are idle slots whose output is never used).

The launcher is a torch custom op (``graphcap_cuda::split_kv_decode``) so that graph recorders
that work on operators (graphcap's CPU reference graph) and ``torch.compile`` see one opaque
operation. With ``TRITON_INTERPRET=1`` set before import it runs on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Columns per block: the unit of skipping and of each K/V load.
BLOCK_N = 64
#: Programs to aim for per launch (a few per multiprocessor) when choosing the split count.
PROGRAMS_PER_SM = 4
#: Warps per program of the partial kernel.
NUM_WARPS = 4


@triton.jit
def _split_kv_partial(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_mb,
    kv_heads,
    groups,
    length,
    chunk,
    head_dim,
    scale,
    softcap,
    blocked,
    MASK_BOOL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row_head = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    row = row_head // kv_heads
    head = row_head % kv_heads
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_ok = g < groups
    d_ok = d < head_dim
    q = tl.load(
        q_ptr + row * stride_qb + (head * groups + g)[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    k_base = k_ptr + row * stride_kb + head * stride_kh
    v_base = v_ptr + row * stride_vb + head * stride_vh
    best = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = split * chunk
    stop = tl.minimum(start + chunk, length)
    for first in range(start, stop, BLOCK_N):
        cols = first + n
        inside = cols < stop
        seen = tl.load(mask_ptr + row * stride_mb + cols, mask=inside, other=0)
        if MASK_BOOL:
            allowed = inside & (seen != 0)
            bias = tl.where(allowed, 0.0, float("-inf"))
        else:
            bias = seen.to(tl.float32)
            allowed = inside & (bias > blocked)
            bias = tl.where(allowed, bias, float("-inf"))
        if tl.max(allowed.to(tl.int32), axis=0) > 0:
            kv_mask = inside[:, None] & d_ok[None, :]
            k = tl.load(k_base + cols[:, None] * stride_kn + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vn + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = scores * scale
            if SOFTCAP:  # tanh(x / c) * c, with tanh(y) = 1 - 2 / (exp(2y) + 1)
                scores = softcap - 2.0 * softcap / (tl.exp(2.0 * scores / softcap) + 1.0)
            scores = scores + bias[None, :]
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            keep = tl.exp(best - new_best)
            weights = tl.exp(scores - new_best[:, None])
            total = total * keep + tl.sum(weights, axis=1)
            if IEEE:
                update = tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            else:
                update = tl.dot(weights.to(v.dtype), v)
            acc = acc * keep[:, None] + update
            best = new_best
    out = (row_head * splits + split) * BLOCK_G + g
    tl.store(acc_ptr + out[:, None] * BLOCK_D + d[None, :], acc)
    tl.store(max_ptr + out, best)
    tl.store(sum_ptr + out, total)


@triton.jit
def _split_kv_combine(
    acc_ptr,
    max_ptr,
    sum_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    kv_heads,
    groups,
    head_dim,
    splits,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row_head = tl.program_id(0)
    row = row_head // kv_heads
    head = row_head % kv_heads
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    base = row_head * splits * BLOCK_G
    best = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for split in range(0, splits):
        best = tl.maximum(best, tl.load(max_ptr + base + split * BLOCK_G + g))
    anchor = tl.where(best == float("-inf"), 0.0, best)  # a row with nothing to attend
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for split in range(0, splits):
        at = base + split * BLOCK_G + g
        weight = tl.exp(tl.load(max_ptr + at) - anchor)
        total += weight * tl.load(sum_ptr + at)
        acc += weight[:, None] * tl.load(acc_ptr + at[:, None] * BLOCK_D + d[None, :])
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(
        out_ptr + row * stride_ob + (head * groups + g)[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(g < groups)[:, None] & (d < head_dim)[None, :],
    )


def split_count(rows: int, kv_heads: int, length: int, device: torch.device) -> int:
    """Chunks per (row, K/V head): enough programs to fill the device, whole blocks each."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 132  # an H100/H200's count: the interpreter on CPU needs some number
    blocks = triton.cdiv(length, BLOCK_N)
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, rows * kv_heads)
    return max(1, min(blocks, wanted))


@torch.library.custom_op("graphcap_cuda::split_kv_decode", mutates_args=())
def split_kv_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """One decode token per row: query (B, H, D), key/value (B, Hkv, L, D) with unit stride in
    the last dimension, mask (B, L) bool (True attends) or additive (entries at or below the
    dtype's minimum are skipped). ``softcap`` 0 means none. Returns (B, H, D) in query's dtype."""
    rows, heads, head_dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    block_g = max(16, triton.next_power_of_2(groups))
    block_d = max(16, triton.next_power_of_2(head_dim))
    splits = split_count(rows, kv_heads, length, query.device)
    chunk = triton.cdiv(triton.cdiv(length, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(length, chunk)
    stats = (rows * kv_heads, splits, block_g)
    acc = torch.empty(*stats, block_d, dtype=torch.float32, device=query.device)
    best = torch.empty(stats, dtype=torch.float32, device=query.device)
    total = torch.empty(stats, dtype=torch.float32, device=query.device)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    mask_bool = mask.dtype == torch.bool
    blocked = float("-inf") if mask_bool else torch.finfo(mask.dtype).min
    _split_kv_partial[(rows * kv_heads, splits)](
        query,
        key,
        value,
        mask,
        acc,
        best,
        total,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        mask.stride(0),
        kv_heads,
        groups,
        length,
        chunk,
        head_dim,
        scale,
        softcap or 1.0,
        blocked,
        MASK_BOOL=mask_bool,
        SOFTCAP=bool(softcap),
        IEEE=query.dtype == torch.float32,
        BLOCK_G=block_g,
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
        num_warps=NUM_WARPS,
    )
    _split_kv_combine[(rows * kv_heads,)](
        acc,
        best,
        total,
        out,
        out.stride(0),
        out.stride(1),
        kv_heads,
        groups,
        head_dim,
        splits,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
    )
    return out


@split_kv_decode.register_fake
def _(query, key, value, mask, scale, softcap):
    return torch.empty_like(query)
