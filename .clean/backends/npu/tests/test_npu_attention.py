"""The NPU attention functions against SDPA, through the documented-semantics kernel doubles."""

from __future__ import annotations

import math

import fake_torch_npu
import pytest
import torch
import torch.nn.functional as F
from graphcap_npu.attention import (
    ATTENTION_NAME,
    FA3_BNSD,
    FA3_BSH,
    FORWARDS,
    IMPLEMENTATIONS,
    fusion_attention_forward,
    to_masked_out,
)

pytestmark = fake_torch_npu.without_real_torch_npu

B, NQ, NKV, D = 2, 4, 2, 8


class _Attn(torch.nn.Module):
    is_causal = True


def _qkv(q_len: int, kv_len: int, kv_heads: int = NKV, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, NQ, q_len, D, generator=gen)
    k = torch.randn(B, kv_heads, kv_len, D, generator=gen)
    v = torch.randn(B, kv_heads, kv_len, D, generator=gen)
    return q, k, v


def _sdpa(q, k, v, mask=None, is_causal=False, scale=None):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    return out.transpose(1, 2)


def _padded_causal_attend(q_len: int, kv_len: int) -> torch.Tensor:
    """Bool (True = attend): row 0 has 2 left-pad keys, queries are the last q_len positions."""
    offset = kv_len - q_len
    rows = torch.arange(q_len)[:, None] + offset
    causal = torch.arange(kv_len)[None, :] <= rows
    attend = causal.expand(B, 1, q_len, kv_len).clone()
    attend[0, :, :, :2] = False
    return attend


def _dtype(name: str) -> torch.dtype:
    """npu_fused_infer_attention_score has no fp32: its tests run in bf16."""
    return torch.bfloat16 if IMPLEMENTATIONS[name].kernel == "infer_score" else torch.float32


def _calls(name: str) -> list[dict]:
    if IMPLEMENTATIONS[name].kernel == "infer_score":
        return fake_torch_npu.INFER_CALLS
    return fake_torch_npu.FUSION_CALLS


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_bool_mask_matches_sdpa(fake_npu, name: str) -> None:
    dtype = _dtype(name)
    q, k, v = (t.to(dtype) for t in _qkv(3, 7))
    attend = _padded_causal_attend(3, 7)
    attend[0, :, 0] = True  # no pad query row here: every row attends to something
    out, weights = FORWARDS[name](_Attn(), q, k, v, attend)
    assert weights is None
    assert out.shape == (B, 3, NQ, D) and out.dtype == dtype
    expected = _sdpa(q.float(), k.float(), v.float(), attend)
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), expected, **tolerance)
    (call,) = _calls(name)
    assert call["input_layout"] == IMPLEMENTATIONS[name].layout
    assert call.get("head_num", call.get("num_heads")) == NQ
    assert call.get("num_key_value_heads", NKV) == NKV
    assert call["scale"] == pytest.approx(1 / math.sqrt(D))
    assert call["atten_mask"].dtype == torch.bool
    assert torch.equal(call["atten_mask"], ~attend)
    assert call["inner_precise"] == 2  # a masked multi-token query may hold empty rows


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min])
def test_additive_mask_matches_sdpa(fake_npu, fill: float) -> None:
    q, k, v = _qkv(3, 7, seed=1)
    attend = _padded_causal_attend(3, 7)
    additive = torch.zeros(attend.shape).masked_fill(~attend, fill)
    out, _ = fusion_attention_forward(_Attn(), q, k, v, additive, scaling=0.3)
    torch.testing.assert_close(out, _sdpa(q, k, v, attend, scale=0.3))
    assert fake_torch_npu.FUSION_CALLS[-1]["scale"] == 0.3


def test_no_mask_prefill_is_causal_like_sdpa(fake_npu) -> None:
    q, k, v = _qkv(5, 5, seed=2)
    out, _ = fusion_attention_forward(_Attn(), q, k, v, None)
    torch.testing.assert_close(out, _sdpa(q, k, v, is_causal=True))
    # An empty static cache: more keys than queries, top-left aligned like SDPA's is_causal.
    q, k, v = _qkv(3, 6, seed=3)
    out, _ = fusion_attention_forward(_Attn(), q, k, v, None)
    torch.testing.assert_close(out, _sdpa(q, k, v, is_causal=True))


def test_no_mask_decode_and_non_causal_attend_everything(fake_npu) -> None:
    q, k, v = _qkv(1, 6, seed=4)
    out, _ = fusion_attention_forward(_Attn(), q, k, v, None)
    torch.testing.assert_close(out, _sdpa(q, k, v))
    q, k, v = _qkv(4, 4, seed=5)
    out, _ = fusion_attention_forward(_Attn(), q, k, v, None, is_causal=False)
    torch.testing.assert_close(out, _sdpa(q, k, v))
    assert fake_torch_npu.FUSION_CALLS[-1]["atten_mask"] is None


def test_multi_head_attention_without_grouping(fake_npu) -> None:
    q, k, v = _qkv(2, 5, kv_heads=NQ, seed=6)
    attend = _padded_causal_attend(2, 5)
    out, _ = fusion_attention_forward(_Attn(), q, k, v, attend)
    torch.testing.assert_close(out, _sdpa(q, k, v, attend))


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_pad_query_rows_of_a_prefill_are_finite(fake_npu, name: str) -> None:
    """A left-padded prefill's pad queries attend to nothing: inner_precise=2 keeps them finite."""
    dtype = _dtype(name)
    q, k, v = (t.to(dtype) for t in _qkv(4, 4, seed=7))
    attend = torch.ones(4, 4, dtype=torch.bool).tril().expand(B, 1, 4, 4).clone()
    attend[0, ..., :2] = False  # row 0: two left pads, so its first two queries see nothing
    out, _ = FORWARDS[name](_Attn(), q, k, v, attend)
    assert torch.isfinite(out).all()
    assert _calls(name)[-1]["inner_precise"] == 2
    expected = _sdpa(q.float(), k.float(), v.float(), attend)
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out[0, 2:].float(), expected[0, 2:], **tolerance)


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_decode_step_runs_without_invalid_row_correction(fake_npu, name: str) -> None:
    """A single-token query always attends to its own key, so the slower mode is never asked."""
    dtype = _dtype(name)
    q, k, v = (t.to(dtype) for t in _qkv(1, 6, seed=12))
    attend = torch.ones(B, 1, 1, 6, dtype=torch.bool)
    attend[1, ..., :4] = False
    out, _ = FORWARDS[name](_Attn(), q, k, v, attend)
    assert _calls(name)[-1]["inner_precise"] == 0
    expected = _sdpa(q.float(), k.float(), v.float(), attend)
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), expected, **tolerance)


def test_double_does_lose_fully_masked_rows_without_inner_precise(fake_npu) -> None:
    """The double is strict: the inner_precise choice above is what keeps those rows finite."""
    q, k, v = _qkv(1, 6, seed=8)
    masked_out = torch.zeros(B, 1, 1, 6, dtype=torch.bool)
    masked_out[1] = True
    out = fake_torch_npu.npu_fusion_attention_v3(
        q, k, v, NQ, "BNSD", atten_mask=masked_out, scale=0.5
    )[0]
    assert torch.isnan(out[1]).all()
    assert torch.isfinite(out[0]).all()


def test_mask_shapes_are_broadcast_to_kernel_forms(fake_npu) -> None:
    q, k, v = _qkv(3, 7, seed=9)
    # (1, N, q, kv): the kernel has no 1NSS mask form.
    per_head = torch.rand(1, NQ, 3, 7, generator=torch.Generator().manual_seed(0)) > 0.3
    per_head[..., 0] = True
    out, _ = fusion_attention_forward(_Attn(), q, k, v, per_head)
    torch.testing.assert_close(out, _sdpa(q, k, v, per_head))
    assert fake_torch_npu.FUSION_CALLS[-1]["atten_mask"].shape == (B, NQ, 3, 7)
    # (B, 1, 1, kv): one padding row for every query.
    pad = torch.ones(B, 1, 1, 7, dtype=torch.bool)
    pad[0, ..., :2] = False
    out, _ = fusion_attention_forward(_Attn(), q, k, v, pad)
    torch.testing.assert_close(out, _sdpa(q, k, v, pad))
    # (q, kv)
    square = torch.ones(3, 7, dtype=torch.bool).tril(4)
    out, _ = fusion_attention_forward(_Attn(), q, k, v, square)
    torch.testing.assert_close(out, _sdpa(q, k, v, square))


def test_half_precision(fake_npu) -> None:
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(2, 5, seed=10))
    attend = _padded_causal_attend(2, 5)
    out, _ = fusion_attention_forward(_Attn(), q, k, v, attend)
    assert out.dtype == torch.bfloat16
    expected = _sdpa(q.float(), k.float(), v.float(), attend)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_bad_inputs_get_clear_errors(fake_npu) -> None:
    q, k, v = _qkv(2, 5)
    three_heads = torch.randn(B, 3, 5, D)
    with pytest.raises(ValueError, match="whole multiple"):
        fusion_attention_forward(_Attn(), q, three_heads, three_heads, None)
    with pytest.raises(ValueError, match="key length"):
        fusion_attention_forward(_Attn(), q, k, v, torch.ones(B, 1, 2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="ambiguous"):
        fusion_attention_forward(_Attn(), q, k, v, torch.ones(B, 1, 2, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="one dtype"):
        fusion_attention_forward(_Attn(), q.half(), k, v, None)
    with pytest.raises(ValueError, match="dropout"):
        fusion_attention_forward(_Attn(), q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match="softcap"):
        fusion_attention_forward(_Attn(), q, k, v, None, softcap=30.0)
    assert fake_torch_npu.FUSION_CALLS == []


def test_to_masked_out_keeps_supported_shapes() -> None:
    attend = torch.ones(1, 1, 4, 6, dtype=torch.bool).tril(2)
    converted = to_masked_out(attend, batch=3, heads=2, q_len=4, kv_len=6)
    assert converted.shape == (1, 1, 4, 6)  # 11SS is a kernel form: no copy per batch row
    assert converted.is_contiguous()
    assert torch.equal(converted, ~attend)


def test_missing_v3_is_explained(fake_npu, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.delattr(sys.modules["torch_npu"], "npu_fusion_attention_v3")
    q, k, v = _qkv(1, 3)
    with pytest.raises(RuntimeError, match="no npu_fusion_attention_v3"):
        fusion_attention_forward(_Attn(), q, k, v, None)


def test_capturable_in_a_cpu_graph(fake_npu) -> None:
    """No host reads: captured once, the call follows a mask updated in place between replays."""
    from graphcap.cpu.backend import CPUBackend

    backend = CPUBackend()
    q, k, v = _qkv(1, 6, seed=11)
    attend = torch.ones(B, 1, 1, 6, dtype=torch.bool)
    out = torch.empty(B, 1, NQ, D)
    graph = backend.create_graph()
    with backend.capture_to_graph(graph):
        out.copy_(fusion_attention_forward(_Attn(), q, k, v, attend)[0])
    for row_pad in (0, 2, 4):
        attend.fill_(True)
        attend[1, ..., :row_pad] = False
        backend.replay_graph(graph)
        torch.testing.assert_close(out, _sdpa(q, k, v, attend))


@pytest.mark.parametrize("name", [FA3_BSH, FA3_BNSD])
def test_registration_gives_transformers_a_mask(fake_npu, name: str) -> None:
    """A tiny Llama with left padding: same logits as SDPA only if the mask function is there."""
    from graphcap_npu.attention import register_attention
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import AttentionMaskInterface

    try:
        assert register_attention(name) == name
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        ids = torch.randint(0, 64, (2, 6))
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[0, :3] = 0
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            model.set_attn_implementation("sdpa")
            expected = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
            model.set_attn_implementation(name)
            got = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
        assert fake_torch_npu.FUSION_CALLS, "the registered function was not used"
        assert fake_torch_npu.FUSION_CALLS[0]["atten_mask"] is not None
        torch.testing.assert_close(got[0, 3:], expected[0, 3:])  # real tokens of the padded row
        torch.testing.assert_close(got[1], expected[1])
    finally:
        # private: transformers offers register() but no way to remove a global registration
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


def test_default_name() -> None:
    assert ATTENTION_NAME == FA3_BSH == "graphcap_npu_fa3"
    assert fusion_attention_forward is FORWARDS[FA3_BSH]


def test_unknown_name_is_refused() -> None:
    from graphcap_npu.attention import register_attention

    with pytest.raises(ValueError, match="unknown graphcap_npu attention 'graphcap_npu_fa2'"):
        register_attention("graphcap_npu_fa2")


def test_infer_kernel_refuses_fp32_and_per_head_masks(fake_npu) -> None:
    from graphcap_npu.attention import FIAS_BSH

    q, k, v = _qkv(1, 5)
    with pytest.raises(TypeError, match=f"float16, bfloat16; got torch.float32.*{FA3_BSH}"):
        FORWARDS[FIAS_BSH](_Attn(), q, k, v, None)
    per_head = torch.ones(1, NQ, 1, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="one mask for all heads"):
        FORWARDS[FIAS_BSH](_Attn(), q.bfloat16(), k.bfloat16(), v.bfloat16(), per_head)
    assert fake_torch_npu.INFER_CALLS == []


def _paged_call(**changes):
    """A page-attention call the double accepts, with ``changes`` applied."""
    q = torch.randn(2, 4, 1, 16, dtype=torch.bfloat16)
    pool = torch.randn(5, 2, 16, 16, dtype=torch.bfloat16)
    kwargs = {
        "atten_mask": torch.zeros(2, 1, 1, 32, dtype=torch.bool),
        "actual_seq_lengths_kv": [20, 7],
        "block_table": torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        "block_size": 16,
        "num_heads": 4,
        "num_key_value_heads": 2,
        "input_layout": "BNSD",
        "scale": 0.25,
    }
    kwargs.update(changes)
    key = kwargs.pop("key", pool)
    return fake_torch_npu.npu_fused_infer_attention_score(q, key, key.clone(), **kwargs)


def test_the_double_serves_a_documented_page_attention_call() -> None:
    out, _ = _paged_call()
    assert out.shape == (2, 4, 1, 16) and torch.isfinite(out.float()).all()


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        ({"block_table": torch.tensor([[1, 2], [3, 0]])}, "int32"),  # int64
        ({"block_table": torch.tensor([1, 2, 3, 0], dtype=torch.int32)}, "int32"),  # 1-D
        ({"block_table": torch.tensor([[1], [3]], dtype=torch.int32)}, "entries"),
        ({"block_size": 8, "key": torch.randn(5, 2, 8, 16, dtype=torch.bfloat16)}, "of 16"),
        ({"actual_seq_lengths_kv": None}, "needs actual_seq_lengths_kv"),
        ({"actual_seq_lengths_kv": torch.tensor([20, 7])}, "list of ints"),
        ({"actual_seq_lengths_kv": [20, 7.0]}, "Python ints"),
        ({"actual_seq_lengths_kv": []}, "for a batch of 2"),
        ({"input_layout": "BSH"}, "BNSD or TND query"),
        ({"key": torch.randn(2, 2, 16, 16, dtype=torch.bfloat16)}, "fewer than the lengths"),
        ({"atten_mask": torch.zeros(2, 1, 1, 16, dtype=torch.bool)}, "fewer than the block"),
        ({"num_key_value_heads": 3}, "times num_key_value_heads"),
    ],
)
def test_the_double_refuses_what_torch_npu_documents_against(changes, refusal) -> None:
    with pytest.raises((RuntimeError, TypeError), match=refusal):
        _paged_call(**changes)
