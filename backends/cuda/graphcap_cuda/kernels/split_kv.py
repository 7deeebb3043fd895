"""Split-KV decode attention in Triton: grouped-query K/V read as they are, and only the cache
columns the mask lets a row attend to.

A decode step's query is one token per row; the static cache holds every column the rollout will
ever write. The columns are split into chunks (enough programs to fill the device even at batch 1).
Each program first reads its chunk's mask (2 bytes a column, up to 1,024 columns at once: blockwise,
the scan was a large share of the kernel; docs/decisions.md, decision 6) to find the span from the
first to the last open column, then walks only that span in blocks of columns, loading K/V of open
columns alone: unwritten columns, left padding and columns outside a sliding window are never read.
The per-row lengths thus live on the device, in the mask the engine updates each step, so one
captured graph serves every step; and the walk has no branch, so Triton pipelines its loads. The
query heads that share a K/V head are computed together from one read of it.

With several chunks, the chunk of a row and K/V head that finishes last combines their partial
softmaxes (an arrival count per row and head, reset by that chunk), so a launch is one kernel
and one graph node. Accumulation is fp32; fp32 inputs use IEEE (not TF32) products so fp32
results match SDPA to rounding. A row with no column to attend gets zeros (SDPA would average
V; such rows are idle slots, never read).

On a block KV table (:mod:`graphcap.kv_blocks`, ``graphcap_cuda::split_kv_decode_paged``) the
same kernel reads K/V from the layer's pools: each column it loads is found through the row's
table entry (one int32 load a column, shared by K and V), so any block size works and a tile
may span blocks; the scan and the walk stop at the row's length (``lengths``, on the device
like the table), so blocks past it are never read, whatever the mask says. Chunking follows the
logical row length, as on the static cache.

The launchers are torch custom ops (``graphcap_cuda::split_kv_decode`` and ``..._paged``) so
that graph recorders that work on operators (graphcap's CPU reference graph) and
``torch.compile`` see one opaque operation. With ``TRITON_INTERPRET=1`` set before import they
run on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap_cuda.kernels import launch

launch.use_inductors_ptxas()

#: Bytes of one K (or V) block (the unit of each load) when the rows and K/V heads alone fill
#: the device: 32 columns at head_dim 128 in bf16, 64 at head_dim 64. The byte count, not the
#: column count, is what the fastest block of both head sizes agreed on (docs/decisions.md,
#: decision 5).
BLOCK_BYTES = 8192
#: Columns per block when they do not (batch 1: fewer, longer chunks).
BLOCK_N_FEW_ROWS = 128
#: Programs per multiprocessor a launch may have: the chunk count per row and K/V head is the
#: most that keeps rows x K/V heads x chunks within this many a multiprocessor (at least one
#: chunk). One: a program with 128-column blocks holds the multiprocessor's shared memory, and
#: every chunk past one adds partials for the last chunk to combine. The previous rule (two a
#: multiprocessor, rounded up) launched several waves of 128-column programs at 4-16 rows and
#: was slower over every block width and chunk count swept at 1-32 rows (docs/decisions.md,
#: decision 4). With eight K/V heads, 64 rows and more, and batch 1 on 640 columns, launch as
#: before.
PROGRAMS_PER_SM = 1
#: Most bytes of one K (or V) block: 128 columns of bf16 at head_dim 128. Wider heads (256) or
#: fp32 take fewer columns a block, or the pipelined loads outgrow shared memory (an fp32 test
#: at head_dim 80 asked for more than a Hopper multiprocessor has).
MAX_BLOCK_BYTES = 32768
#: Warps per program of the partial kernel.
NUM_WARPS = 4
#: Software-pipeline depth of the partial kernel's K/V loads (None: Triton's default).
NUM_STAGES: int | None = None
#: Most columns of the mask the span scan reads at once (a power of two).
MAX_SCAN = 1024


@triton.jit
def _open_columns(mask_ptr, cols, inside, blocked, MASK_BOOL: tl.constexpr):
    """Which of ``cols`` the row may attend, and the additive bias of each (-inf if not)."""
    seen = tl.load(mask_ptr + cols, mask=inside, other=0)
    if MASK_BOOL:
        allowed = inside & (seen != 0)
        bias = tl.where(allowed, 0.0, float("-inf"))
    else:
        bias = seen.to(tl.float32)
        allowed = inside & (bias > blocked)
        bias = tl.where(allowed, bias, float("-inf"))
    return allowed, bias


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """fp32 operands multiply in IEEE fp32 (Triton's default would be TF32)."""
    return tl.dot(a, b, input_precision="ieee") if IEEE else tl.dot(a, b)


@triton.jit
def _split_kv_partial(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    out_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    count_ptr,
    table_ptr,
    lengths_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_mb,
    stride_tb,
    stride_ob,
    stride_oh,
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
    DIRECT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCAN_N: tl.constexpr,
    PAGED: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched dependent (kernels.launch): everything read may be the last kernel's
        tl.extra.cuda.gdc_wait()
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
    mask_row = mask_ptr + row * stride_mb
    start = split * chunk
    stop = tl.minimum(start + chunk, length)
    if PAGED:  # the row holds K/V in [0, lengths[row]) only: columns past it are not scanned
        stop = tl.maximum(start, tl.minimum(stop, tl.load(lengths_ptr + row)))
    # The open span [lo, hi) of this chunk, from the mask alone (2 bytes a column): K/V outside
    # it are never read, and the loop below has no branch, so Triton can pipeline its loads.
    lo = stop
    hi = start
    for first in range(start, stop, SCAN_N):
        cols = first + tl.arange(0, SCAN_N)
        allowed, _ = _open_columns(mask_row, cols, cols < stop, blocked, MASK_BOOL)
        lo = tl.minimum(lo, tl.min(tl.where(allowed, cols, stop), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(allowed, cols + 1, start), axis=0))
    q = tl.load(
        q_ptr + row * stride_qb + (head * groups + g)[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if PAGED:  # stride_kb / stride_vb step over pool blocks; the table picks the block
        k_base = k_ptr + head * stride_kh
        v_base = v_ptr + head * stride_vh
    else:
        k_base = k_ptr + row * stride_kb + head * stride_kh
        v_base = v_ptr + row * stride_vb + head * stride_vh
    best = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for first in range(lo, hi, BLOCK_N):
        cols = first + n
        inside = cols < hi
        allowed, bias = _open_columns(mask_row, cols, inside, blocked, MASK_BOOL)
        kv_mask = allowed[:, None] & d_ok[None, :]  # closed columns inside the span: not read
        if PAGED:  # column c: offset c % KV_BLOCK of block table[row, c // KV_BLOCK]
            block = tl.load(table_ptr + row * stride_tb + cols // KV_BLOCK, mask=allowed, other=0)
            block = block.to(tl.int64)
            k_cols = block * stride_kb + (cols % KV_BLOCK) * stride_kn
            v_cols = block * stride_vb + (cols % KV_BLOCK) * stride_vn
        else:
            k_cols = cols * stride_kn
            v_cols = cols * stride_vn
        k = tl.load(k_base + k_cols[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + v_cols[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = _dot(q, tl.trans(k), IEEE) * scale
        if SOFTCAP:  # tanh(x / c) * c, with tanh(y) = 1 - 2 / (exp(2y) + 1)
            scores = softcap - 2.0 * softcap / (tl.exp(2.0 * scores / softcap) + 1.0)
        scores = tl.where(allowed[None, :], scores + bias[None, :], float("-inf"))
        # the first block holds column lo, which is open: maxima are finite from then on
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        keep = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        total = total * keep + tl.sum(weights, axis=1)
        acc = acc * keep[:, None] + _dot(weights.to(v.dtype), v, IEEE)
        best = new_best
    if PDL:  # the next kernel may start (right after the wait instead: no faster)
        tl.extra.cuda.gdc_launch_dependents()
    rows_ok = g_ok[:, None] & d_ok[None, :]
    if DIRECT:  # one chunk per row: normalise and write the output here
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        tl.store(
            out_ptr + row * stride_ob + (head * groups + g)[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=rows_ok,
        )
    else:
        at = (row_head * splits + split) * BLOCK_G + g
        tl.store(acc_ptr + at[:, None] * BLOCK_D + d[None, :], acc, mask=rows_ok)
        tl.store(max_ptr + at, best, mask=g_ok)
        tl.store(sum_ptr + at, total, mask=g_ok)
        # Every thread's partials are stored before the count says so; the chunk that arrives
        # last (acquiring the others' stores) combines them, then resets the count for the
        # next launch, so one kernel serves a step and a replay needs no zeroing.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + row_head, 1, sem="acq_rel")
        if arrived == splits - 1:
            _combine(
                acc_ptr,
                max_ptr,
                sum_ptr,
                out_ptr,
                row,
                head,
                row_head,
                splits,
                stride_ob,
                stride_oh,
                groups,
                head_dim,
                BLOCK_G,
                BLOCK_D,
            )
            tl.store(count_ptr + row_head, 0)


@triton.jit
def _combine(
    acc_ptr,
    max_ptr,
    sum_ptr,
    out_ptr,
    row,
    head,
    row_head,
    splits,
    stride_ob,
    stride_oh,
    groups,
    head_dim,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The chunks' partial softmaxes of one row and K/V head as one output. Loads bypass L1
    (``.cg``): other programs wrote the partials."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    base = row_head * splits * BLOCK_G
    best = tl.full([BLOCK_G], float("-inf"), tl.float32)
    g_ok = g < groups
    rows_ok = g_ok[:, None] & (d < head_dim)[None, :]
    for split in range(0, splits):
        at = base + split * BLOCK_G + g
        best = tl.maximum(best, tl.load(max_ptr + at, mask=g_ok, other=0.0, cache_modifier=".cg"))
    anchor = tl.where(best == float("-inf"), 0.0, best)  # a row with nothing to attend
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for split in range(0, splits):
        at = base + split * BLOCK_G + g
        seen = tl.load(max_ptr + at, mask=g_ok, other=float("-inf"), cache_modifier=".cg")
        weight = tl.exp(seen - anchor)
        total += weight * tl.load(sum_ptr + at, mask=g_ok, other=0.0, cache_modifier=".cg")
        acc += weight[:, None] * tl.load(
            acc_ptr + at[:, None] * BLOCK_D + d[None, :],
            mask=rows_ok,
            other=0.0,
            cache_modifier=".cg",
        )
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(
        out_ptr + row * stride_ob + (head * groups + g)[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rows_ok,
    )


def launch_shape(
    rows: int, kv_heads: int, length: int, device: torch.device, block_bytes: int
) -> tuple[int, int]:
    """(columns per block, chunks per row and K/V head): at most one wave of programs.
    ``block_bytes``: one column of a K block as loaded (padded head_dim x element size, a power
    of two)."""
    sms = launch.multiprocessors(device)
    fill = rows * kv_heads >= sms
    block_n = BLOCK_N_FEW_ROWS if not fill else max(16, BLOCK_BYTES // block_bytes)
    while block_n > 16 and block_n * block_bytes > MAX_BLOCK_BYTES:
        block_n //= 2
    blocks = triton.cdiv(length, block_n)
    wanted = PROGRAMS_PER_SM * sms // (rows * kv_heads)
    return block_n, max(1, min(blocks, wanted))


def chunking(length: int, block_n: int, wanted: int) -> tuple[int, int]:
    """(columns per chunk, chunks): ``wanted`` chunks rounded to whole blocks, so some counts
    launch alike (640 columns in 128-column blocks: 5 wanted or 16 give five chunks)."""
    chunk = triton.cdiv(triton.cdiv(length, wanted), block_n) * block_n
    return chunk, triton.cdiv(length, chunk)


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
    return _launch(query, key, value, mask, scale, softcap, None)


@split_kv_decode.register_fake
def _(query, key, value, mask, scale, softcap):
    return torch.empty_like(query)


@torch.library.custom_op("graphcap_cuda::split_kv_decode_paged", mutates_args=())
def split_kv_decode_paged(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """:func:`split_kv_decode` over a block table (:mod:`graphcap.kv_blocks`): key/value are
    pools (num_blocks, Hkv, block_size, D), table (B, blocks_per_row) int32 block ids, lengths
    (B,) int32, mask (B, blocks_per_row * block_size) over logical columns. Row ``b`` reads
    columns ``[0, lengths[b])`` its mask opens, each through the table on the device (any block
    size: columns are addressed one by one, so a tile may span blocks)."""
    return _launch(query, key, value, mask, scale, softcap, (table, lengths))


@split_kv_decode_paged.register_fake
def _(query, key, value, mask, table, lengths, scale, softcap):
    return torch.empty_like(query)


def _launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
    blocks: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """One launch of the partial kernel over contiguous K/V (``blocks`` None) or pools read
    through ``blocks`` = (table, lengths); the launch shape follows the logical row length."""
    rows, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    length = key.shape[2] if blocks is None else blocks[0].shape[1] * key.shape[2]
    groups = heads // kv_heads
    block_g = max(16, triton.next_power_of_2(groups))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_bytes = block_d * key.element_size()
    block_n, splits = launch_shape(rows, kv_heads, length, query.device, block_bytes)
    chunk, splits = chunking(length, block_n, splits)
    scan_n = max(block_n, min(MAX_SCAN, triton.next_power_of_2(chunk)))
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    direct = splits == 1  # no partial results to combine
    stats = (rows * kv_heads, splits, block_g)
    acc, best, total = (
        (out, out, out)
        if direct
        else (
            torch.empty(*stats, block_d, dtype=torch.float32, device=query.device),
            torch.empty(stats, dtype=torch.float32, device=query.device),
            torch.empty(stats, dtype=torch.float32, device=query.device),
        )
    )
    counts = out if direct else launch.arrival_counts(query.device, rows * kv_heads)
    table, lengths = (out, out) if blocks is None else blocks  # unread when not paged
    mask_bool = mask.dtype == torch.bool
    pdl = launch.dependent(query.device)
    blocked = float("-inf") if mask_bool else torch.finfo(mask.dtype).min
    _split_kv_partial[(rows * kv_heads, splits)](
        query,
        key,
        value,
        mask,
        out,
        acc,
        best,
        total,
        counts,
        table,
        lengths,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        mask.stride(0),
        0 if blocks is None else table.stride(0),
        out.stride(0),
        out.stride(1),
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
        DIRECT=direct,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SCAN_N=scan_n,
        PAGED=blocks is not None,
        KV_BLOCK=1 if blocks is None else key.shape[2],
        PDL=pdl,
        num_warps=NUM_WARPS,
        launch_pdl=pdl,
        **({} if NUM_STAGES is None else {"num_stages": NUM_STAGES}),
    )
    return out
