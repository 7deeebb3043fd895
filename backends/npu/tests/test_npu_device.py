"""On a real Ascend NPU only (GRAPHCAP_BACKEND=npu): graphs, the fused kernel, the KV table.

Nothing here has run yet: there is no Ascend hardware where this was written. Elsewhere every
test is skipped with the reason.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from graphcap_npu import GrowableKVTable, NPUBackend, fusion_attention_forward


def _skip_reason() -> str | None:
    if os.environ.get("GRAPHCAP_BACKEND") != "npu":
        return "real-NPU test: set GRAPHCAP_BACKEND=npu on an Ascend machine to run it"
    availability = NPUBackend.availability()
    return None if availability.ok else f"npu backend unavailable: {availability.reason}"


pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or ""),
]


class _Attn(torch.nn.Module):
    is_causal = True


@pytest.fixture
def backend() -> NPUBackend:
    return NPUBackend()


def test_graph_replays_on_new_inputs(backend: NPUBackend) -> None:
    x = torch.ones(4, device=backend.device)
    y = torch.zeros(4, device=backend.device)
    graph = backend.create_graph()
    side = backend.new_stream()
    side.wait_stream(backend.current_stream())
    with backend.stream(side):
        y.copy_(x * 2)  # warm-up outside the capture
    backend.current_stream().wait_stream(side)
    with backend.capture_to_graph(graph):
        y.copy_(x * 3)
    x.fill_(5.0)
    backend.replay_graph(graph)
    backend.synchronize()
    assert torch.equal(y.cpu(), torch.full((4,), 15.0))


def _reference(q, k, v, attend):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attend)
    return out.transpose(1, 2)


def test_fused_attention_matches_sdpa(backend: NPUBackend) -> None:
    device = backend.device
    q = torch.randn(2, 8, 3, 64, dtype=torch.float16, device=device)
    k = torch.randn(2, 2, 10, 64, dtype=torch.float16, device=device)
    v = torch.randn(2, 2, 10, 64, dtype=torch.float16, device=device)
    attend = torch.ones(2, 1, 3, 10, dtype=torch.bool, device=device).tril(7)
    attend[0, ..., :3] = False
    out, _ = fusion_attention_forward(_Attn(), q, k, v, attend)
    torch.testing.assert_close(out.float(), _reference(q, k, v, attend), atol=5e-3, rtol=5e-3)
    attend[1] = False  # an inactive slot
    out, _ = fusion_attention_forward(_Attn(), q, k, v, attend)
    assert torch.isfinite(out).all()


def test_captured_decode_attention_over_the_kv_table(backend: NPUBackend) -> None:
    device = backend.device
    table = GrowableKVTable(16, is_capturing=backend.is_current_stream_capturing)
    q = torch.randn(2, 8, 1, 64, dtype=torch.float16, device=device)
    k_new = torch.randn(2, 2, 1, 64, dtype=torch.float16, device=device)
    v_new = torch.randn(2, 2, 1, 64, dtype=torch.float16, device=device)
    prefill = torch.randn(2, 2, 4, 64, dtype=torch.float16, device=device)
    table.update(prefill, prefill.clone(), layer_idx=0)
    table.advance(4)
    attend = torch.zeros(2, 1, 1, 16, dtype=torch.bool, device=device)
    attend[..., :5] = True
    out = torch.empty(2, 1, 8, 64, dtype=torch.float16, device=device)
    graph = backend.create_graph()
    with backend.capture_to_graph(graph):
        keys, values = table.update(k_new, v_new, layer_idx=0)
        out.copy_(fusion_attention_forward(_Attn(), q, keys, values, attend)[0])
        table.advance(1)
    for _ in range(3):
        backend.replay_graph(graph)
        backend.synchronize()
        keys, values = table.layer(0)
        expected = _reference(q, keys, values, attend)
        torch.testing.assert_close(out.float(), expected, atol=5e-3, rtol=5e-3)
        attend[..., int(table.positions)] = True  # host update between replays, as the engine does
    assert int(table.positions) == 7
