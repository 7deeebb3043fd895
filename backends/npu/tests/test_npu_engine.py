"""RolloutEngine end to end on the NPU backend, with torch_npu replaced by its CPU double.

The backend under test is NPUBackend itself (its capabilities, graph hooks, side stream and
attention offer), only placed on the host: the double's NPUGraph records into graphcap's CPU
graph, so a replay really re-runs the captured kernels, and its attention kernels follow
torch_npu's documented semantics (True = masked out, NaN for an uncorrected empty row).
"""

from __future__ import annotations

from typing import ClassVar

import fake_torch_npu
import pytest
import torch
from graphcap_npu import ATTENTION_VAR, FA3_BNSD, FA3_BSH, FIAS_BNSD, FIAS_BSH, NPUBackend

from graphcap.cpu import CPUBackend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.testing import models

pytestmark = fake_torch_npu.without_real_torch_npu

NEW = 10


class HostNPUBackend(NPUBackend):
    """NPUBackend with its tensors on the host (the double has no device memory)."""

    device_type: ClassVar[str] = "cpu"


def _llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = models.build("llama", torch.device("cpu")).to(dtype)  # 4 query heads, 2 K/V heads
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    return model


def _eager(model, ids, mask, params, **config):
    engine = RolloutEngine(model, RolloutConfig(backend=CPUBackend(), **config))
    return engine.generate(ids, mask, params)


def _calls(name: str) -> list[dict]:
    if name in (FIAS_BSH, FIAS_BNSD):
        return fake_torch_npu.INFER_CALLS
    return fake_torch_npu.FUSION_CALLS


@pytest.mark.parametrize(
    ("attention", "dtype"),
    [
        (None, torch.float32),  # the backend's default: v3 in BSH
        (FA3_BNSD, torch.float32),
        (FIAS_BSH, torch.bfloat16),  # the inference kernel has no fp32
        (FIAS_BNSD, torch.bfloat16),
    ],
)
def test_static_graph_through_the_plugin_attention_equals_eager_sdpa(
    fake_npu, monkeypatch: pytest.MonkeyPatch, attention: str | None, dtype: torch.dtype
) -> None:
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    backend = HostNPUBackend(attention=attention)
    name = attention or FA3_BSH
    model = _llama(dtype)
    ids, mask = models.prompts(4, torch.device("cpu"), width=6)  # rows 1 and 3 left-padded
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
    engine = RolloutEngine(model, RolloutConfig(backend=backend, enable_graph_capture=True))
    result = engine.generate(ids, mask, params)
    assert result.stats.path == "static_graph", result.stats.fallback_reason
    assert result.stats.attention == name
    assert result.stats.replays == NEW - 1
    calls = _calls(name)
    assert calls, f"{name} was never called"
    assert {c["input_layout"] for c in calls} == {"BSH" if "bnsd" not in name else "BNSD"}
    assert {c["inner_precise"] for c in calls} == {0}  # decode rows are never empty
    # restored after capture (private: transformers has no public getter for it)
    assert model.config._attn_implementation == "sdpa"
    expected = _eager(model, ids, mask, params)
    assert torch.equal(result.sequences, expected.sequences)
    assert len(set(result.sequences[:, 6:].flatten().tolist())) > 3  # tokens vary


def test_continuous_graph_with_idle_slots_equals_eager(fake_npu, monkeypatch) -> None:
    """Idle and finished slots write into the sink column and attend to it, so no decode row is
    ever empty: the kernel runs without invalid-row correction, and the double (NaN for an
    uncorrected empty row) still gives eager's tokens."""
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    empty_row_seen = _watch_for_empty_rows(monkeypatch)
    model = _llama()
    ids, mask = models.prompts(5, torch.device("cpu"), width=5, seed=3)
    params = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
    limits = [3, 9, 2, 10, 5]  # slots free up at different steps, the queue runs dry
    graph_config = RolloutConfig(
        backend=HostNPUBackend(), enable_graph_capture=True, continuous_batch_size=3
    )
    result = RolloutEngine(model, graph_config).generate(
        ids, mask, params, request_max_new_tokens=limits
    )
    assert result.stats.path == "continuous_graph", result.stats.fallback_reason
    assert result.stats.attention == FA3_BSH
    assert fake_torch_npu.FUSION_CALLS
    assert {c["inner_precise"] for c in fake_torch_npu.FUSION_CALLS} == {0}
    eager = RolloutEngine(
        model, RolloutConfig(backend=CPUBackend(), continuous_batch_size=3)
    ).generate(ids, mask, params, request_max_new_tokens=limits)
    assert torch.equal(result.sequences, eager.sequences)
    assert not empty_row_seen.item(), "a decode row had nothing to attend to"


def _watch_for_empty_rows(monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """A flag the v3 kernel sets (on the device, so also in replays) when a row of its mask is
    fully masked out."""
    import sys

    seen = torch.zeros((), dtype=torch.bool)
    kernel = fake_torch_npu.npu_fusion_attention_v3

    def watched(*args, atten_mask=None, **kwargs):
        if atten_mask is not None:
            seen.logical_or_(atten_mask.all(dim=-1).any())
        return kernel(*args, atten_mask=atten_mask, **kwargs)

    monkeypatch.setattr(sys.modules["torch_npu"], "npu_fusion_attention_v3", watched)
    return seen


def test_graph_attention_none_keeps_the_model_attention(fake_npu, monkeypatch) -> None:
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    model = _llama()
    ids, mask = models.prompts(2, torch.device("cpu"))
    params = SamplingParams(max_new_tokens=4, eos_token_id=[])
    config = RolloutConfig(
        backend=HostNPUBackend(), enable_graph_capture=True, graph_attention=None
    )
    result = RolloutEngine(model, config).generate(ids, mask, params)
    assert result.stats.path == "static_graph"
    assert result.stats.attention == "sdpa"
    assert fake_torch_npu.FUSION_CALLS == []
