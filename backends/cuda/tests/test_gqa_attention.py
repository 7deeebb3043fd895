"""The grouped-query SDPA attention equals transformers' SDPA (and eager soft-capping) on CPU:
directly, inside models (GQA, padding, sliding windows), and in captured rollout steps."""

from __future__ import annotations

import pytest
import torch
from graphcap_cuda import CUDABackend, plugin
from graphcap_cuda.attention import GQA_SDPA, gqa_sdpa_forward, register_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from graphcap.cpu import CPUBackend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.tiny_models import prompts, tiny_model

register_attention()


class Attn(torch.nn.Module):
    """What attention functions read from the module: groups, causality, training."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _qkv(batch=3, heads=8, kv_heads=2, q_len=1, kv_len=9, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=gen)
    k = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    v = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    return q, k, v


def _decode_mask(batch: int, kv_len: int, additive: bool) -> torch.Tensor:
    valid = torch.ones(batch, kv_len, dtype=torch.bool)
    valid[0, :2] = False  # left padding
    valid[1, -2:] = False  # unwritten columns
    valid[2, :2] = False  # outside a window
    mask = valid[:, None, None, :]
    if additive:
        return torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    return mask


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("form", ["additive", "bool", "none"])
def test_decode_and_prefill_equal_transformers_sdpa(kv_heads, form):
    module = Attn(8 // kv_heads).eval()
    for q_len in (1, 5):
        q, k, v = _qkv(kv_heads=kv_heads, q_len=q_len, kv_len=9 if q_len == 1 else 5)
        mask = None
        if form != "none":
            valid = _decode_mask(3, k.shape[2], additive=False)
            if q_len > 1:
                valid = valid & torch.ones(q_len, q_len, dtype=torch.bool).tril()
            mask = valid if form == "bool" else torch.where(valid, 0.0, -1e30)
        out, weights = gqa_sdpa_forward(module, q, k, v, mask, scaling=0.3)
        ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
        assert weights is None and out.shape == (3, q_len, 8, 16)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_causal_prefill_against_a_longer_static_cache_sees_only_earlier_keys():
    module = Attn(4).eval()
    q, k, v = _qkv(q_len=4, kv_len=10)
    out, _ = gqa_sdpa_forward(module, q, k, v, None)
    ref, _ = sdpa_attention_forward(module, q, k[:, :, :4], v[:, :, :4], None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q_len", [1, 4])
def test_softcap_is_eager_soft_capped_attention(q_len):
    module = Attn(4).eval()
    q, k, v = _qkv(q_len=q_len, kv_len=9)
    q = q * 6  # logits well past the cap, so a missing tanh shows
    mask = _decode_mask(3, 9, additive=True)
    if q_len > 1:
        causal = torch.ones(q_len, 9, dtype=torch.bool).tril(9 - q_len)
        mask = mask + torch.where(causal, 0.0, torch.finfo(torch.float32).min)
    out, _ = gqa_sdpa_forward(module, q, k, v, mask, scaling=0.25, softcap=5.0)
    ref, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25, softcap=5.0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_attention_sinks_are_refused_clearly():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="s_aux"):
        gqa_sdpa_forward(Attn(4).eval(), q, k, v, None, s_aux=torch.zeros(8))


def _gemma2() -> torch.nn.Module:
    """Sliding-window layers and attention-logit soft-capping, which the GQA SDPA refuses."""
    capping = {"attn_logit_softcapping": 2.0, "final_logit_softcapping": None}
    return tiny_model("gemma2", "eager", sliding_window=3, tie_word_embeddings=True, **capping)


MODELS = {
    "llama": lambda: tiny_model("llama"),
    "qwen2": lambda: tiny_model("qwen2"),
    "mistral-window": lambda: tiny_model("mistral", sliding_window=3),
    "gemma2-softcap": _gemma2,
}


def _logits(model, attention: str, ids, mask) -> torch.Tensor:
    model.set_attn_implementation(attention)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("family", list(MODELS))
def test_model_logits_equal_its_own_attention(family):
    model = MODELS[family]()
    own = model.config._attn_implementation  # private: transformers has no public getter
    ids, mask = prompts(3, width=8)
    expected = _logits(model, own, ids, mask)
    got = _logits(model, GQA_SDPA, ids, mask)
    real = mask.bool()  # pad query rows attend to nothing real; compare the real ones
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)


def check_captured_steps_equal_eager(family: str, attention: str) -> None:
    """Captured steps running ``attention`` (selected as a backend's graph attention would be)
    give the eager loop's tokens in fp32."""
    backend = type("AttentionBackend", (CPUBackend,), {"graph_attention": attention})()
    model = MODELS[family]()
    ids, mask = prompts(4, width=7)
    params = SamplingParams(max_new_tokens=8, eos_token_id=[])
    graph = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=backend))
    result = graph.generate(ids, mask, params)
    assert result.stats.path == "static_graph", result.stats.fallback_reason
    assert result.stats.attention == attention
    config = RolloutConfig(backend=CPUBackend(), enable_graph_capture=False)
    eager = RolloutEngine(model, config).generate(ids, mask, params)
    assert torch.equal(result.sequences, eager.sequences)
    assert len(set(result.sequences[:, 7:].flatten().tolist())) > 3  # tokens vary


@pytest.mark.parametrize("family", list(MODELS))
def test_captured_steps_with_gqa_attention_are_token_equal_to_eager(family):
    check_captured_steps_equal_eager(family, GQA_SDPA)


def test_backend_default_attention_is_the_plugins():
    assert CUDABackend.graph_attention in plugin.graphcap_attention_implementations(CUDABackend())
