"""The split-KV kernel on a CUDA device: bf16 outputs within bf16 rounding of a float64
reference (the CPU interpreter cannot run bf16), fp32 captured tokens equal eager ones on model
families with GQA, padding, sliding windows and soft-capping, and bf16 teacher-forced decode
logits within rounding of SDPA. Run with GRAPHCAP_BACKEND=cuda (backends/cuda/run_on_gpu.sh)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graphcap_cuda.attention import SPLIT_KV, register_attention
from test_gqa_attention import MODELS

from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.tiny_models import prompts

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]

register_attention(SPLIT_KV)


@pytest.mark.parametrize("rows,written", [(1, 70), (16, 400), (64, 300), (256, 640)])
def test_bf16_kernel_within_rounding_of_float64(rows, written):
    from graphcap_cuda.kernels.split_kv import split_kv_decode

    q = torch.randn(rows, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, rows, 8, 640, 128, device="cuda", dtype=torch.bfloat16)
    valid = torch.arange(640, device="cuda")[None] < written
    valid = valid & (torch.rand(rows, 640, device="cuda") > 0.1)
    valid[:, 0] = True
    additive = torch.where(valid, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)
    ref = F.scaled_dot_product_attention(
        q[:, :, None].double(),
        k.double(),
        v.double(),
        attn_mask=valid[:, None, None],
        enable_gqa=True,
    )[:, :, 0]
    for mask in (valid, additive):
        out = split_kv_decode(q, k, v, mask, 128**-0.5, 0.0).double()
        assert ((out - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("rows,written,block_size", [(1, 70, 16), (64, 300, 16), (256, 640, 32)])
def test_bf16_paged_kernel_equals_the_contiguous_kernel(rows, written, block_size):
    """The paged kernel over pools behind a permuted block table (ragged lengths, the mask open
    past them) returns the contiguous kernel's result on the same K/V to bf16 rounding."""
    from graphcap_cuda.kernels.split_kv import split_kv_decode, split_kv_decode_paged

    from graphcap import kv_blocks

    q = torch.randn(rows, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, rows, 8, 640, 128, device="cuda", dtype=torch.bfloat16)
    per_row = 640 // block_size
    table = (1 + torch.randperm(rows * per_row, device="cuda")).view(rows, per_row).int()
    lengths = torch.randint(1, written + 1, (rows,), device="cuda", dtype=torch.int32)
    lengths[0] = written
    view = kv_blocks.BlockView(table, lengths, block_size)
    pools = []
    for tensor in (k, v):
        pool = torch.zeros(1 + rows * per_row, 8, block_size, 128, device="cuda", dtype=q.dtype)
        pool[table.long()] = tensor.view(rows, 8, per_row, block_size, 128).transpose(1, 2)
        pools.append(pool)
    valid = torch.rand(rows, 640, device="cuda") > 0.1
    valid[:, 0] = True
    needed = valid & (torch.arange(640, device="cuda")[None] < lengths[:, None].long())
    paged = split_kv_decode_paged(q, *pools, valid, view.table, view.lengths, 128**-0.5, 0.0)
    contiguous = split_kv_decode(q, k, v, needed, 128**-0.5, 0.0)
    torch.testing.assert_close(paged, contiguous, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("family", list(MODELS))
def test_fp32_captured_tokens_equal_eager(family):
    model = MODELS[family]().cuda()
    ids, mask = (t.cuda() for t in prompts(4, width=8))
    params = SamplingParams(max_new_tokens=16, eos_token_id=[])
    config = RolloutConfig(enable_graph_capture=True, backend="cuda")  # the default attention
    result = RolloutEngine(model, config).generate(ids, mask, params)
    assert result.stats.path == "static_graph", result.stats.fallback_reason
    assert result.stats.attention == SPLIT_KV
    config = RolloutConfig(backend="cuda", enable_graph_capture=False)
    eager = RolloutEngine(model, config).generate(ids, mask, params)
    assert torch.equal(result.sequences, eager.sequences)
