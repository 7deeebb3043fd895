"""The grouped-query SDPA attention on a CUDA device: fp32 logits and captured tokens equal the
model's own SDPA; bf16 logits within bf16 rounding of it. Run with GRAPHCAP_BACKEND=cuda
(backends/cuda/run_on_gpu.sh); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from graphcap_cuda.attention import GQA_SDPA, register_attention
from transformers import LlamaConfig, LlamaForCausalLM

from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.tiny_models import prompts, tiny_model

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]

register_attention()


def _logits(model, attention: str, ids, mask) -> torch.Tensor:
    own = model.config._attn_implementation  # private: transformers has no public getter
    model.set_attn_implementation(attention)
    try:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits.float()
    finally:
        model.set_attn_implementation(own)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_fp32_logits_and_captured_tokens_equal_sdpa(family):
    window = {"sliding_window": 3} if family == "mistral" else {}
    model = tiny_model(family, **window).cuda()
    ids, mask = (t.cuda() for t in prompts(4, width=8))
    real = mask.bool()
    torch.testing.assert_close(
        _logits(model, GQA_SDPA, ids, mask)[real],
        _logits(model, "sdpa", ids, mask)[real],
        rtol=1e-5,
        atol=1e-5,
    )
    params = SamplingParams(max_new_tokens=16, eos_token_id=[])
    config = RolloutConfig(enable_graph_capture=True, backend="cuda", graph_attention=GQA_SDPA)
    result = RolloutEngine(model, config).generate(ids, mask, params)
    assert result.stats.path == "static_graph", result.stats.fallback_reason
    assert result.stats.attention == GQA_SDPA
    config = RolloutConfig(backend="cuda", enable_graph_capture=False)
    eager = RolloutEngine(model, config).generate(ids, mask, params)
    assert torch.equal(result.sequences, eager.sequences)


def test_bf16_logits_within_rounding_of_sdpa():
    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1024,
        initializer_range=0.05,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids, mask = (t.cuda() for t in prompts(8, width=64))
    ids = ids.clamp(max=config.vocab_size - 1)
    real = mask.bool()
    got = _logits(model, GQA_SDPA, ids, mask)[real]
    expected = _logits(model, "sdpa", ids, mask)[real]
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 0.03 * scale
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.95
