"""On a real Ascend NPU only (GRAPHCAP_BACKEND=npu): graphs, the fused kernels, the engine.

Nothing here has run yet: there is no Ascend hardware where this was written. Elsewhere every
test is skipped with the reason.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from graphcap_npu import IMPLEMENTATIONS, NPUBackend, register_attention
from graphcap_npu.attention import FORWARDS

from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.testing import models


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


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_fused_attention_matches_sdpa(backend: NPUBackend, name: str) -> None:
    device, forward = backend.device, FORWARDS[name]
    q = torch.randn(2, 8, 3, 64, dtype=torch.float16, device=device)
    k = torch.randn(2, 2, 10, 64, dtype=torch.float16, device=device)
    v = torch.randn(2, 2, 10, 64, dtype=torch.float16, device=device)
    attend = torch.ones(2, 1, 3, 10, dtype=torch.bool, device=device).tril(7)
    attend[0, ..., :3] = False
    attend[0, :, 0] = False  # a pad query row: nothing to attend to (inner_precise=2)
    out, _ = forward(_Attn(), q, k, v, attend)
    real = (slice(None), slice(1, None))
    expected = _reference(q, k, v, attend)
    torch.testing.assert_close(out[1].float(), expected[1], atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(out[0, 1:].float(), expected[0, 1:], atol=5e-3, rtol=5e-3)
    assert torch.isfinite(out[real]).all()
    decode_q = q[:, :, -1:].contiguous()
    out, _ = forward(_Attn(), decode_q, k, v, attend[:, :, -1:])
    expected = _reference(decode_q, k, v, attend[:, :, -1:])
    torch.testing.assert_close(out.float(), expected, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_engine_graph_path_through_each_attention(backend: NPUBackend, name: str) -> None:
    """RolloutEngine's captured decode steps through each implementation give eager SDPA's
    tokens: exactly in fp32 (v3); npu_fused_infer_attention_score has no fp32, and fp16 kernels
    round differently from SDPA, so there nine in ten tokens must agree."""
    register_attention(name)
    half = IMPLEMENTATIONS[name].kernel == "infer_score"
    ids, mask = models.prompts(3, backend.device)
    params = SamplingParams(max_new_tokens=8, eos_token_id=[])
    model = models.build("llama", backend.device)
    model = model.half() if half else model
    eager_config = RolloutConfig(backend=backend, enable_graph_capture=False)
    eager = RolloutEngine(model, eager_config).generate(ids, mask, params)
    config = RolloutConfig(backend=backend, enable_graph_capture=True, graph_attention=name)
    result = RolloutEngine(model, config).generate(ids, mask, params)
    assert result.stats.path == "static_graph", result.stats.fallback_reason
    assert result.stats.attention == name
    if not half:
        assert torch.equal(result.sequences.cpu(), eager.sequences.cpu())
    else:
        agree = (result.sequences.cpu() == eager.sequences.cpu()).float().mean().item()
        assert agree > 0.9, f"{name}: {agree:.0%} of tokens agree with eager SDPA"


@pytest.mark.parametrize("continuous", [False, True], ids=["static", "continuous"])
def test_page_attention_graph_equals_eager_on_the_block_table(
    backend: NPUBackend, continuous: bool
) -> None:
    """fp16 decode steps through page attention over the block table (the backend's default),
    captured with auto_dispatch_capture and updated with each replay's lengths, give the tokens
    of eager steps running the same kernel with the same lengths (the model's own attention set
    to it); against eager SDPA on the static cache nine in ten tokens must agree (fp16)."""
    from graphcap_npu import BLOCKS

    register_attention(BLOCKS)
    ids, mask = models.prompts(5, backend.device)
    params = SamplingParams(max_new_tokens=40, eos_token_id=[])
    extra = {"continuous_batch_size": 3} if continuous else {}
    calls = {"request_max_new_tokens": [40, 7, 25, 3, 33]} if continuous else {}
    model = models.build("llama", backend.device, BLOCKS).half()
    runs = {}
    for graph in (False, True):
        config = RolloutConfig(backend=backend, enable_graph_capture=graph, **extra)
        runs[graph] = RolloutEngine(model, config).generate(ids, mask, params, **calls)
    stats = runs[True].stats
    assert stats.path in ("static_graph", "continuous_graph"), stats.fallback_reason
    assert stats.kv_layout == "blocks" and stats.attention == BLOCKS
    assert torch.equal(runs[True].sequences.cpu(), runs[False].sequences.cpu())
    model.set_attn_implementation("sdpa")
    sdpa = RolloutConfig(backend=backend, kv_block_size=None, enable_graph_capture=False, **extra)
    reference = RolloutEngine(model, sdpa).generate(ids, mask, params, **calls)
    agree = (runs[True].sequences.cpu() == reference.sequences.cpu()).float().mean().item()
    assert agree > 0.9, f"{agree:.0%} of tokens agree with eager SDPA on the static cache"


@pytest.mark.parametrize("continuous", [False, True], ids=["static", "continuous"])
def test_page_attention_over_rows_of_several_blocks(backend: NPUBackend, continuous: bool) -> None:
    """Batch 8 (6 slots), 16-column blocks, rows reaching five blocks: the capture's placeholder
    lengths fit the pool as it is when captured (after growths), slots retire and refill inside
    the first check interval, each update is ordered after the replay before it; tokens equal
    eager steps running the same kernel."""
    from graphcap_npu import BLOCKS

    register_attention(BLOCKS)
    ids, mask = models.prompts(8, backend.device, width=20)
    params = SamplingParams(max_new_tokens=60, eos_token_id=[])
    extra = {"continuous_batch_size": 6} if continuous else {}
    calls = {"request_max_new_tokens": [2, 60, 7, 55, 5, 40, 9, 30]} if continuous else {}
    model = models.build("llama", backend.device, BLOCKS).half()
    runs = {}
    for graph in (False, True):
        config = RolloutConfig(
            backend=backend, enable_graph_capture=graph, kv_block_size=16, **extra
        )
        runs[graph] = RolloutEngine(model, config).generate(ids, mask, params, **calls)
    stats = runs[True].stats
    assert stats.path in ("static_graph", "continuous_graph"), stats.fallback_reason
    assert stats.kv_pool_growths >= 1
    assert torch.equal(runs[True].sequences.cpu(), runs[False].sequences.cpu())


def test_failed_capture_leaves_torch_npu_as_it_found_it(backend: NPUBackend) -> None:
    """npu_fusion_attention (v1) works on an internal secondary stream, which fails capture_end
    (error 107025): afterwards no graph dispatch mode of torch_npu is left on, the caller's
    stream is current again, and page attention runs eagerly."""
    import torch_npu
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from graphcap.errors import GraphCaptureError

    q = torch.randn(1, 64, 2, 128, dtype=torch.float16, device=backend.device)  # BSH: 2 heads
    stream = backend.current_stream()
    graph = backend.create_graph()
    try:
        with backend.capture_to_graph(graph, stream=backend.new_stream()):
            torch_npu.npu_fusion_attention(
                q.view(1, 64, 256), q.view(1, 64, 256), q.view(1, 64, 256), 2, "BSH"
            )
    except GraphCaptureError:
        pass
    else:
        pytest.skip("npu_fusion_attention (v1) captured on this torch_npu: no failure to check")
    assert not any(
        type(mode).__name__ == "_GraphDispatchMode" for mode in _get_current_dispatch_mode_stack()
    )
    assert backend.current_stream() == stream
    assert not backend.is_current_stream_capturing()
    pool = torch.randn(4, 2, 128, 128, dtype=torch.float16, device=backend.device)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q[:, :1].reshape(1, 2, 1, 128).contiguous(),
        pool,
        pool,
        actual_seq_lengths_kv=[100],
        block_table=torch.tensor([[1]], dtype=torch.int32, device=backend.device),
        block_size=128,
        num_heads=2,
        num_key_value_heads=2,
        input_layout="BNSD",
    )
    assert torch.isfinite(out.float()).all()


def test_keyed_draw_is_exact_and_its_cost_against_the_greedy_step(backend: NPUBackend) -> None:
    """The per-row keyed draw (issue 55): about 20 uncompiled int64 kernels over batch x
    vocabulary. Its int64 -> float32 cast must round as the CPU's does over all of [0, 2**32)
    (a cast through int32 would turn values from 2**31 on negative, and the noise NaN), the hash
    must be bit-exact, and its cost is printed against the greedy step's argmax over the same
    scores (256 rows, a 128,256-token vocabulary)."""
    from graphcap.rollout.sampling import RowSettings, argmax_rows, gumbel, hash32

    device = backend.device
    edges = [0, 1, 2**23 - 1, 2**24 + 1, 2**31 - 1, 2**31, 2**31 + 129, 2**32 - 1]
    values = torch.tensor(edges + torch.randint(0, 2**32, (4096,)).tolist(), dtype=torch.long)
    assert torch.equal(values.to(device).float().cpu(), values.float())
    assert torch.equal(hash32(values.to(device)).cpu(), hash32(values))

    batch, vocab = 256, 128256
    rows = RowSettings.allocate(batch, vocab, device)
    rows.key.copy_(torch.randint(0, 2**32, (batch,), dtype=torch.long).to(device))
    generated = torch.arange(batch, device=device)
    noise = gumbel(rows, generated)
    assert bool(torch.isfinite(noise).all())
    on_host = RowSettings.allocate(batch, vocab, torch.device("cpu"))
    on_host.key.copy_(rows.key.cpu())
    torch.testing.assert_close(noise.cpu(), gumbel(on_host, generated.cpu()), rtol=1e-5, atol=1e-5)

    scores = torch.randn(batch, vocab, device=device)

    def seconds(step) -> float:
        for _ in range(3):
            step()
        backend.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            step()
        backend.synchronize()
        return (time.perf_counter() - start) / 20

    greedy = seconds(lambda: argmax_rows(scores))
    keyed = seconds(lambda: argmax_rows(scores + gumbel(rows, generated)))
    print(
        f"\nkeyed draw at {batch} x {vocab}: {keyed * 1e3:.3f} ms a step, greedy argmax "
        f"{greedy * 1e3:.3f} ms ({keyed / greedy:.1f}x) on {backend.device}"
    )
    assert keyed > 0 and greedy > 0
