"""The split-KV Triton decode kernel equals SDPA, skips only blocks its mask closes, and serves
captured rollout steps token-equal to eager ones.

Off the GPU it runs under Triton's interpreter (conftest.py sets ``TRITON_INTERPRET=1``), which
cannot multiply bfloat16 (its NumPy emulation returns garbage), so bf16 is checked on the GPU
(test_gqa_attention_cuda.py) and fp32 / fp16 here.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip(
    "triton", reason="the split-KV kernel needs Triton (CUDA builds of torch ship it)"
)

from graphcap_cuda import CUDABackend, plugin
from graphcap_cuda.attention import (
    SPLIT_KV,
    register_attention,
    softcapped_attention,
    split_kv_forward,
)
from graphcap_cuda.kernels import launch, split_kv
from graphcap_cuda.kernels.split_kv import split_kv_decode, split_kv_decode_paged
from test_gqa_attention import MODELS, check_captured_steps_equal_eager

from graphcap import kv_blocks
from graphcap.cpu import CPUBackend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

register_attention(SPLIT_KV)

#: Columns the test caches are laid out in (padding, holes and prefixes over whole blocks of
#: the launch shapes' widths and not).
BLOCK_N = 64
#: Under the interpreter the kernel takes CPU tensors; compiled, it takes CUDA ones.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"


def _case(rows, heads, kv_heads, length, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(rows, kv_heads, length, dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(rows, kv_heads, length, dim, generator=gen).to(DEVICE, dtype)
    valid = (torch.rand(rows, length, generator=gen) > 0.2).to(DEVICE)
    valid[0, : 2 * BLOCK_N] = False  # left padding over whole blocks
    valid[-1, length // 2 :] = False  # unwritten columns
    valid[:, -1] = True
    return q, k, v, valid


def _reference(q, k, v, valid, scale, softcap=0.0):
    q, k, v = q[:, :, None].double(), k.double(), v.double()
    if softcap:
        out = softcapped_attention(q, k, v, valid[:, None, None], scale, softcap, causal=False)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=valid[:, None, None], scale=scale, enable_gqa=True
        )
    return out[:, :, 0]


@pytest.mark.parametrize(
    "rows,heads,kv_heads,length,dim",
    [(3, 8, 2, 300, 16), (2, 4, 4, 70, 80), (1, 32, 8, 5 * BLOCK_N, 64), (4, 6, 1, 130, 32)],
)
@pytest.mark.parametrize("form", ["bool", "additive"])
def test_kernel_equals_sdpa(rows, heads, kv_heads, length, dim, form):
    for dtype, tol in ((torch.float32, 2e-6), (torch.float16, 2e-3)):
        q, k, v, valid = _case(rows, heads, kv_heads, length, dim, dtype, seed=length + dim)
        mask = valid if form == "bool" else torch.where(valid, 0.0, torch.finfo(dtype).min)
        out = split_kv_decode(q, k, v, mask.to(dtype) if form != "bool" else mask, 0.3, 0.0)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(
            out.double(), _reference(q, k, v, valid, 0.3), rtol=tol, atol=tol
        )


@pytest.mark.parametrize("rows", [1, 256])
@pytest.mark.parametrize("head_dim,itemsize", [(64, 2), (128, 2), (256, 2), (128, 4), (256, 4)])
def test_blocks_stay_within_shared_memory(rows, head_dim, itemsize):
    """Wide heads and fp32 take fewer columns a block; the tuned bf16 blocks stay as tuned:
    as many bytes a block when rows fill the device, as many columns when they do not."""
    column = head_dim * itemsize
    block_n, _ = split_kv.launch_shape(rows, 8, 640, torch.device("cpu"), column)
    assert block_n * column <= split_kv.MAX_BLOCK_BYTES and block_n >= 16
    if column <= 256:
        wanted = split_kv.BLOCK_BYTES // column if rows > 16 else split_kv.BLOCK_N_FEW_ROWS
        assert block_n == wanted


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("length", [100, 640, 2176, 16384])
def test_launch_is_one_wave_of_programs(kv_heads, length):
    """Chunks per row and K/V head: the most that keep the launch within one program a
    multiprocessor (more waves of 128-column programs and more partials to combine were slower
    at 4-32 rows on an H200), never more than the blocks, never fewer than one."""
    cpu = torch.device("cpu")
    sms = launch.multiprocessors(cpu)
    for rows in (1, 2, 3, 4, 8, 16, 17, 32, 64, 256):
        block_n, splits = split_kv.launch_shape(rows, kv_heads, length, cpu, 256)
        pairs, blocks = rows * kv_heads, math.ceil(length / block_n)
        assert 1 <= splits <= blocks
        assert splits == 1 or pairs * splits <= sms
        assert splits == blocks or pairs * (splits + 1) > sms  # no smaller launch fills more


def test_softcapping_equals_the_eager_formula():
    q, k, v, valid = _case(2, 8, 2, 200, 32, torch.float32, seed=3)
    out = split_kv_decode(q * 4, k, v, valid, 0.25, 5.0)
    expected = _reference(q * 4, k, v, valid, 0.25, softcap=5.0)
    torch.testing.assert_close(out.double(), expected, rtol=2e-6, atol=2e-6)


#: 0: one chunk per row, no combine; 64: more chunks than the span has blocks
CHUNKINGS = [split_kv.PROGRAMS_PER_SM, 0, 64]


@pytest.mark.parametrize("programs_per_sm", CHUNKINGS)
def test_closed_columns_are_never_read(programs_per_sm, monkeypatch):
    """NaN in every column the mask closes: a kernel that read one returns NaN."""
    monkeypatch.setattr(split_kv, "PROGRAMS_PER_SM", programs_per_sm)
    q, k, v, valid = _case(3, 8, 2, 6 * BLOCK_N, 16, torch.float32, seed=5)
    valid[:, 2 * BLOCK_N : 4 * BLOCK_N] = False  # two whole blocks of every row
    valid[1, : 2 * BLOCK_N] = False
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k.masked_fill_(~valid[:, None, :, None], float("nan"))
    poisoned_v.masked_fill_(~valid[:, None, :, None], float("nan"))
    out = split_kv_decode(q, poisoned_k, poisoned_v, valid, 0.3, 0.0)
    torch.testing.assert_close(out.double(), _reference(q, k, v, valid, 0.3), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("written", [BLOCK_N // 2, 2 * BLOCK_N + 5, 6 * BLOCK_N])
def test_many_chunks_over_any_written_prefix(written, monkeypatch):
    """More chunks than written blocks (most find nothing open), a prefix that is not a whole
    number of blocks, a span that starts inside a block: every open column attended once."""
    monkeypatch.setattr(split_kv, "PROGRAMS_PER_SM", 16)
    q, k, v, valid = _case(3, 8, 2, 6 * BLOCK_N, 16, torch.float32, seed=written)
    valid[:, written:] = False
    valid[1, :3] = False  # a span that starts inside a block
    out = split_kv_decode(q, k, v, valid, 0.3, 0.0)
    torch.testing.assert_close(out.double(), _reference(q, k, v, valid, 0.3), rtol=2e-6, atol=2e-6)


def test_the_last_chunk_combines_and_leaves_the_counts_at_zero():
    """Several chunks per row and K/V head in one launch: the output is the reference's on
    every launch (a replay relies on it), and the arrival counts are zero after each."""
    q, k, v, valid = _case(3, 8, 2, 6 * BLOCK_N, 16, torch.float32, seed=11)
    splits = split_kv.launch_shape(3, 2, 6 * BLOCK_N, q.device, 16 * 4)[1]
    assert splits > 1
    counts = launch.arrival_counts(q.device, 3 * 2)
    for scale in (0.3, 0.3, 0.7):
        out = split_kv_decode(q, k, v, valid, scale, 0.0)
        expected = _reference(q, k, v, valid, scale)
        torch.testing.assert_close(out.double(), expected, rtol=2e-6, atol=2e-6)
        assert not counts.any()


@pytest.mark.parametrize("programs_per_sm", CHUNKINGS)
def test_a_row_with_nothing_to_attend_gets_zeros(programs_per_sm, monkeypatch):
    monkeypatch.setattr(split_kv, "PROGRAMS_PER_SM", programs_per_sm)
    q, k, v, valid = _case(2, 4, 2, 100, 16, torch.float32, seed=7)
    valid[1] = False
    out = split_kv_decode(q, k, v, valid, 0.3, 0.0)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0].double(), _reference(q, k, v, valid, 0.3)[0])


@pytest.mark.skipif(not INTERPRETED, reason="CPU models need the interpreter (GPU: *_cuda.py)")
@pytest.mark.parametrize("family", list(MODELS))
def test_captured_steps_with_the_kernel_are_token_equal_to_eager(family):
    check_captured_steps_equal_eager(family, SPLIT_KV)


@pytest.mark.skipif(not INTERPRETED, reason="CPU models need the interpreter (GPU: *_cuda.py)")
def test_continuous_slots_with_the_kernel_are_token_equal_to_eager():
    """Refilled slots hold a new request's prompt in a row whose older columns are closed: the
    kernel must attend to only what the slot's mask opens."""
    from graphcap.tiny_models import prompts

    model = MODELS["mistral-window"]()
    ids, mask = prompts(6, width=7)
    params = SamplingParams(max_new_tokens=9, eos_token_id=[])
    budgets = [9, 3, 6, 2, 8, 5]

    def run(backend, graph):
        config = RolloutConfig(enable_graph_capture=graph, backend=backend, continuous_batch_size=2)
        engine = RolloutEngine(model, config)
        return engine.generate(ids, mask, params, request_max_new_tokens=budgets)

    backend = type("SplitKVBackend", (CPUBackend,), {"graph_attention": SPLIT_KV})()
    result = run(backend, True)
    assert result.stats.path == "continuous_graph", result.stats.fallback_reason
    assert result.stats.attention == SPLIT_KV and result.stats.slots_refilled >= 4
    assert torch.equal(result.sequences, run(CPUBackend(), False).sequences)


def test_plugin_offers_both_attentions_to_the_cuda_backend_only():
    assert plugin.graphcap_attention_implementations(CPUBackend()) == {}
    assert set(plugin.graphcap_attention_implementations(CUDABackend())) == {
        "graphcap_gqa_sdpa",
        SPLIT_KV,
    }


def _paged(k, v, valid, block_size, lengths, seed):
    """``k`` / ``v`` (B, Hkv, L, D) laid out in pools of ``block_size`` blocks behind a table of
    permuted block ids. Block 0 is null (zeros) and wholly closed blocks within a row's length
    point there; entries wholly past a row's length point at a stale block of NaN, like every
    block never assigned (a kernel that read one returns NaN). Returns the pools and the view."""
    rows, kv_heads, length, dim = k.shape
    per_row = length // block_size
    gen = torch.Generator().manual_seed(seed)
    total = 1 + rows * per_row + 3  # the null block, every row's blocks, three never assigned
    shuffled = 1 + torch.randperm(total - 1, generator=gen)
    table = shuffled[: rows * per_row].view(rows, per_row)
    first = torch.arange(per_row)[None] * block_size  # each entry's first column
    closed = ~valid.cpu().view(rows, per_row, block_size).any(-1)
    table = torch.where(closed, kv_blocks.NULL_BLOCK, table)
    table = torch.where(first >= lengths.cpu()[:, None], shuffled[-1], table)
    pools = []
    for tensor in (k, v):
        pool = torch.full((total, kv_heads, block_size, dim), float("nan"), dtype=k.dtype)
        blocks = tensor.cpu().view(rows, kv_heads, per_row, block_size, dim).transpose(1, 2)
        live = table != shuffled[-1]
        pool[table[live]] = blocks[live]
        pool[kv_blocks.NULL_BLOCK] = 0
        pools.append(pool.to(DEVICE))
    view = kv_blocks.BlockView(
        table.to(DEVICE, torch.int32), lengths.to(DEVICE, torch.int32), block_size
    )
    return pools, view


@pytest.mark.parametrize(
    "rows,heads,kv_heads,blocks,block_size,dim",
    [
        (3, 8, 2, 20, 16, 16),  # GQA
        (2, 4, 4, 9, 16, 80),  # MHA, head_dim not a power of two
        (4, 6, 1, 13, 5, 32),  # a block size that divides no tile
        (2, 8, 2, 3, 128, 16),  # blocks as wide as a tile
        (2, 4, 2, 2, 256, 16),  # blocks wider than a tile
    ],
)
@pytest.mark.parametrize("programs_per_sm", CHUNKINGS)
def test_paged_kernel_equals_the_contiguous_kernel_and_sdpa(
    rows, heads, kv_heads, blocks, block_size, dim, programs_per_sm, monkeypatch
):
    """Ragged lengths below the row length, columns the mask closes, null blocks and permuted
    block ids: the paged kernel returns what the contiguous kernel and SDPA return on K/V
    gathered through the table, and reads no block it should not (unused ones hold NaN)."""
    monkeypatch.setattr(split_kv, "PROGRAMS_PER_SM", programs_per_sm)
    length = blocks * block_size
    for dtype, tol in ((torch.float32, 2e-6), (torch.float16, 2e-3)):
        q, k, v, valid = _case(rows, heads, kv_heads, length, dim, dtype, seed=length + dim)
        valid[:, -1] = False  # _case opens the last column of every row: lengths end earlier
        lengths = torch.randint(1, length, (rows,), generator=torch.Generator().manual_seed(dim))
        lengths[0] = length  # one row reads its full logical length
        lengths = lengths.to(DEVICE)
        valid[torch.arange(rows), lengths - 1] = True  # the column each row writes this step
        valid[-1, : 2 * block_size] = False  # whole closed blocks at the front: null entries
        (k_pool, v_pool), view = _paged(k, v, valid, block_size, lengths, dim)
        past = torch.arange(length, device=DEVICE)[None] >= lengths[:, None]
        needed = valid & ~past
        # the mask stays open past a row's length: lengths alone bound the columns read
        paged = split_kv_decode_paged(
            q, k_pool, v_pool, valid | past, view.table, view.lengths, 0.3, 0.0
        )
        k_seen, v_seen = kv_blocks.gather(k_pool, view), kv_blocks.gather(v_pool, view)
        contiguous = split_kv_decode(q, k_seen, v_seen, needed, 0.3, 0.0)  # reads no NaN
        closed = ~needed[:, None, :, None]
        k_seen, v_seen = k_seen.masked_fill(closed, 0), v_seen.masked_fill(closed, 0)
        reference = _reference(q, k_seen, v_seen, needed, 0.3)
        torch.testing.assert_close(paged.double(), reference, rtol=tol, atol=tol)
        torch.testing.assert_close(paged, contiguous, rtol=tol, atol=tol)


def test_paged_rows_with_nothing_to_attend_get_zeros():
    """An idle row (length 1 on a closed column) and a row past whose length nothing is open."""
    q, k, v, valid = _case(3, 4, 2, 64, 16, torch.float32, seed=9)
    lengths = torch.tensor([64, 1, 40], device=DEVICE)
    valid[1] = False
    (k_pool, v_pool), view = _paged(k, v, valid, 16, lengths, 9)
    valid[2, :40] = False
    out = split_kv_decode_paged(q, k_pool, v_pool, valid, view.table, view.lengths, 0.3, 0.0)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    torch.testing.assert_close(out[0].double(), _reference(q, k, v, valid, 0.3)[0])


def _pools_of(view, k, v):
    """Pools holding exactly ``k`` / ``v`` behind ``view.table`` (for the attention function)."""
    rows, kv_heads, length, dim = k.shape
    size = view.block_size
    pools = []
    for tensor in (k, v):
        pool = torch.zeros(
            1 + view.table.numel(), kv_heads, size, dim, dtype=tensor.dtype, device=tensor.device
        )  # on the table's device: indexing a host pool with a CUDA table fails (seen on the H200)
        blocks = tensor.view(rows, kv_heads, length // size, size, dim).transpose(1, 2)
        pool[view.table.long()] = blocks
        pools.append(pool)
    return pools


def test_the_attention_function_reads_the_table_in_decode_and_gathers_otherwise(monkeypatch):
    """With a block view current, a decode call runs the paged op on the pools; a multi-token
    call gets the pools gathered (SDPA's result); with none current the contiguous op runs."""
    q, k, v, valid = _case(2, 8, 2, 64, 16, torch.float32, seed=13)
    table = (1 + torch.randperm(8)).view(2, 4).to(DEVICE, torch.int32)
    lengths = torch.tensor([64, 64], dtype=torch.int32, device=DEVICE)  # the kernel reads it
    view = kv_blocks.BlockView(table, lengths, 16)
    k_pool, v_pool = _pools_of(view, k, v)
    module = torch.nn.Module().eval()
    mask = valid[:, None, None]
    calls: list[str] = []
    for name in ("split_kv_decode", "split_kv_decode_paged"):
        op = getattr(split_kv, name)
        monkeypatch.setattr(
            split_kv, name, lambda *a, op=op, name=name: calls.append(name) or op(*a)
        )
    assert kv_blocks.is_block_aware(split_kv_forward)
    expected = _reference(q, k, v, valid, 0.25)
    with kv_blocks.reading_blocks(view):
        out, _ = split_kv_forward(module, q[:, :, None], k_pool, v_pool, mask, scaling=0.25)
        prefill_q = torch.cat([q[:, :, None], q[:, :, None]], dim=2)
        two, _ = split_kv_forward(
            module, prefill_q, k_pool, v_pool, mask.expand(-1, -1, 2, -1), scaling=0.25
        )
    plain, _ = split_kv_forward(module, q[:, :, None], k, v, mask, scaling=0.25)
    assert calls == ["split_kv_decode_paged", "split_kv_decode"]
    for result in (out[:, 0], two[:, 0], two[:, 1], plain[:, 0]):
        torch.testing.assert_close(result.double(), expected, rtol=2e-6, atol=2e-6)


@pytest.mark.skipif(not INTERPRETED, reason="CPU models need the interpreter (GPU: *_cuda.py)")
@pytest.mark.skipif(
    "kv_block_size" not in RolloutConfig.__dataclass_fields__,
    reason="RolloutConfig.kv_block_size comes with the engine's block table (issue 34, core)",
)
def test_continuous_slots_on_a_block_table_run_the_paged_kernel(monkeypatch):
    """RolloutConfig(kv_block_size=16) on the continuous graph path: every captured decode
    forward runs the paged op, and the tokens equal the eager loop's on the static cache."""
    from graphcap.tiny_models import prompts

    model = MODELS["mistral-window"]()
    ids, mask = prompts(6, width=7)
    params = SamplingParams(max_new_tokens=9, eos_token_id=[])
    budgets = [9, 3, 6, 2, 8, 5]
    paged = split_kv.split_kv_decode_paged
    calls: list[int] = []
    monkeypatch.setattr(split_kv, "split_kv_decode_paged", lambda *a: calls.append(1) or paged(*a))

    def run(backend, graph, block_size):
        config = RolloutConfig(
            enable_graph_capture=graph,
            backend=backend,
            continuous_batch_size=2,
            kv_block_size=block_size,
        )
        engine = RolloutEngine(model, config)
        return engine.generate(ids, mask, params, request_max_new_tokens=budgets)

    backend = type("SplitKVBackend", (CPUBackend,), {"graph_attention": SPLIT_KV})()
    result = run(backend, True, 16)
    assert result.stats.path == "continuous_graph", result.stats.fallback_reason
    assert result.stats.attention == SPLIT_KV and calls
    assert torch.equal(result.sequences, run(CPUBackend(), False, None).sequences)
