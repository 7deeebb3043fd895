"""Every declared capability checked against what the backend does.

``rng_in_graph`` is checked in test_rng (replays draw what eager draws) and test_engine (a
backend declaring False gets sampled calls run eagerly, with the reason). Here: the capture
stream (``capture_needs_side_stream`` and the explicit ``stream=`` the engine passes),
``collectives_in_graph`` (a one-rank group of the backend's own distributed backend, captured and
replayed), the plugin's attention (``graph_attention`` and every implementation the plugin
offers, run by the engine's decode step with masks in the declared ``mask_form``, against SDPA),
the backend's one-row product (against ``F.linear``, eagerly and replayed), its fused
sampler (against the core's truncation and keyed draw), and its trainer-exact operations (a
row's bits independent of its company).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import pytest
import torch

from graphcap.backend import Backend
from graphcap.registry import attention_implementations, register_attention_implementations
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.holder.capture import capture_step
from graphcap.rollout.sampling import RowSettings, SamplerShape, select, truncated
from graphcap.testing import models
from graphcap.testing.conformance.replay import replay


def test_capture_stream_is_the_one_passed(gc_graph_backend: Backend) -> None:
    """Where a side stream is declared, the engine's capture_step warms up and captures on
    ``backend.capture_stream()``, passing it as ``stream=``: the backend must capture on exactly
    that stream and give the caller's stream back."""
    backend = gc_graph_backend
    x = torch.ones(4, device=backend.device)
    out: dict[str, torch.Tensor] = {}
    seen: list[object] = []
    before = backend.current_stream()

    def step() -> None:
        seen.append(backend.current_stream())
        out["result"] = x * 3

    graph = capture_step(backend, step, [], None)
    assert backend.current_stream() == before, "capture left another stream current"
    replay(backend, graph)
    assert out["result"].cpu().tolist() == [3.0] * 4
    if not backend.capabilities.capture_needs_side_stream:
        assert seen == [before, before], "without a side stream, work stays on the caller's"
        return
    side = backend.capture_stream()
    assert side != before, "capture_stream() must not be the caller's current stream"
    assert seen == [side, side], (
        "the warm-up and the capture must run on the stream passed as stream= "
        f"(capture_stream()); saw {seen}, expected {side}"
    )


@pytest.fixture
def one_rank_group(gc_graph_backend: Backend, tmp_path: object) -> Iterator[object]:
    import torch.distributed as dist

    if not gc_graph_backend.capabilities.collectives_in_graph:
        pytest.skip(
            f"backend {gc_graph_backend.name!r} declares collectives_in_graph=False: the engine "
            "keeps tensor-parallel collectives out of graphs there"
        )
    if not dist.is_available():
        pytest.fail("collectives_in_graph is declared but torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process; run the suite on its own")
    name = gc_graph_backend.communication_backend_name()
    store = dist.FileStore(str(tmp_path) + "/store", 1)  # type: ignore[operator]
    dist.init_process_group(
        name, store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_collectives_capture_and_replay(gc_graph_backend: Backend, one_rank_group: object) -> None:
    import torch.distributed as dist

    backend = gc_graph_backend
    total = torch.zeros(4, device=backend.device)
    ones = torch.ones(4, device=backend.device)
    dist.all_reduce(total.clone(), group=one_rank_group)  # one collective before capture

    def step() -> None:
        total.add_(ones)
        dist.all_reduce(total, group=one_rank_group)

    graph = capture_step(backend, step, [total], None)
    replay(backend, graph, times=3)
    assert total.cpu().tolist() == [3.0] * 4, (
        "a captured all_reduce on a one-rank group did not replay with the work around it"
    )


def _offered(backend: Backend) -> list[str]:
    names = register_attention_implementations(backend)
    if not names:
        pytest.skip(f"the plugin of {backend.name!r} offers no attention implementations")
    return names


def test_graph_attention_is_offered(gc_backend: Backend) -> None:
    wanted = gc_backend.capabilities.graph_attention
    if wanted is None:
        pytest.skip(f"backend {gc_backend.name!r} keeps the model's attention in graphs")
    assert wanted in attention_implementations(gc_backend), (
        f"graph_attention {wanted!r} is not among the implementations the plugin offers"
    )


@pytest.mark.parametrize("name", list(models.MODELS))
def test_offered_attention_matches_sdpa(gc_backend: Backend, name: str) -> None:
    """Each offered attention, run by the engine (graphs on where the backend captures, so its
    decode step renders masks in ``mask_form`` for it), gives SDPA's tokens and log-probs."""
    backend = gc_backend
    params = SamplingParams(max_new_tokens=6, return_logprobs=True)
    ids, mask = models.prompts(3, backend.device)
    results = {}
    for attn in ["sdpa", *_offered(backend)]:
        model = models.build(name, backend.device, attn)
        config = RolloutConfig(backend=backend, enable_graph_capture=attn != "sdpa")
        engine = RolloutEngine(model, config)
        results[attn] = engine.generate(ids, mask, params)
        engine.shutdown()
    reference = results.pop("sdpa")
    for attn, result in results.items():
        assert torch.equal(result.sequences.cpu(), reference.sequences.cpu()), (
            f"attention {attn!r} chose other tokens than SDPA"
        )
        torch.testing.assert_close(
            result.logprobs.cpu(), reference.logprobs.cpu(), rtol=1e-3, atol=1e-3
        )


def test_one_row_product_matches_linear(gc_backend: Backend) -> None:
    """A backend's ``one_row_product`` equals ``F.linear`` (fp32, to rounding) for one row, for
    a row slice of a joined buffer and with a bias; hands other inputs to ``F.linear``; and,
    where the backend captures, replays reading an input updated in place."""
    backend = gc_backend
    product = backend.one_row_product()
    if product is None:
        pytest.skip(f"backend {backend.name!r} offers no one-row product (F.linear is used)")
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(backend.device)

    joined, bias = rand(96, 200), rand(40)
    for x, weight, b in [
        (rand(1, 1, 200), joined, None),
        (rand(1, 200), joined[24:64], bias),  # a joined group's member: rows of a buffer
        (rand(3, 1, 200), joined[:40], bias),  # three rows: F.linear's job
    ]:
        torch.testing.assert_close(
            product(x, weight, b), torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5
        )
    if not backend.capabilities.graph_capture:
        return
    x = rand(1, 1, 200)
    out: dict[str, torch.Tensor] = {}
    graph = capture_step(backend, lambda: out.update(y=product(x, joined, None)), [], None)
    x.copy_(rand(1, 1, 200))
    replay(backend, graph)
    expected = torch.nn.functional.linear(x, joined)
    torch.testing.assert_close(out["y"], expected, rtol=1e-5, atol=1e-5)


def test_truncated_draw_matches_the_reference(gc_backend: Backend) -> None:
    """A backend's ``truncated_draw`` keeps the core's set (top-k, top-p after top-k, min-p;
    rows without ties at a cut) and draws the core's keyed tokens from the same key; greedy
    rows get the argmax."""
    backend = gc_backend
    draw = backend.truncated_draw()
    if draw is None:
        pytest.skip(f"backend {backend.name!r} offers no fused sampler (the core's math is used)")
    settings = [
        {"top_k": 7},
        {"top_p": 0.9, "temperature": 0.7},
        {"min_p": 0.05},
        {"top_k": 40, "top_p": 0.8, "min_p": 0.01},
        {"temperature": 1.3},
    ]
    params = [SamplingParams(do_sample=True, seed=3 + i, **s) for i, s in enumerate(settings)]
    params.append(SamplingParams())
    rows, vocab = len(params), 1537  # not a multiple of any power-of-two block
    gen = torch.Generator().manual_seed(0)
    scores = (torch.randn(rows, vocab, generator=gen) * 3).to(backend.device)
    table = RowSettings.allocate(rows, vocab, backend.device)
    table.write(params, [0] * rows)
    finished = torch.zeros(rows, dtype=torch.bool, device=backend.device)
    generated = torch.tensor([4], device=backend.device)
    tokens, cut = draw(
        scores, table.temperature, table.top_k, table.top_p_floor, table.min_p, table.sample,
        table.seeded, table.key, finished, generated,
    )  # fmt: skip
    shape = SamplerShape(samples=True, truncates=True, keyed=True)
    expected = select(scores, table, finished, generated, None, shape).tokens
    assert torch.equal(tokens.cpu(), expected.cpu()), "the keyed draws differ from the core's"
    scaled = scores / table.temperature[:, None]
    kept = truncated(scaled, table) > -float("inf")
    ours = scaled >= cut[:, None]
    assert torch.equal(ours[:-1].cpu(), kept[:-1].cpu()), "the kept sets differ from the core's"


def test_exact_ops_give_a_row_the_same_bits_whatever_its_company(gc_backend: Backend) -> None:
    """A backend's trainer-exact operations (float32): the product of one row alone equals the
    same row among 37; a decode query reading a left-padded cache equals the same position of
    a full causal forward; the row reductions it offers give a lone row a batch row's bits; all
    within float32 tolerance of the plain math."""
    backend = gc_backend
    ops = backend.exact_ops()
    if ops is None:
        pytest.skip(f"backend {backend.name!r} offers no trainer-exact operations")
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(backend.device)

    x, weight = randn(37, 96), randn(70, 96)
    out = ops.linear(x, weight, None)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4)
    assert torch.equal(ops.linear(x[5:6], weight, None)[0], out[5])
    length, pad, cache = 70, 9, 100
    q, k, v = randn(1, 4, length, 16), randn(1, 2, length, 16), randn(1, 2, length, 16)
    causal = torch.ones(length, length, dtype=torch.bool, device=backend.device).tril()
    positions = torch.arange(length, device=backend.device)[None]
    full = ops.attention(None, q, k, v, causal[None, None], position_ids=positions)[0]
    keys = torch.zeros(1, 2, cache, 16, device=backend.device)
    values = torch.zeros_like(keys)
    keys[:, :, pad : pad + length], values[:, :, pad : pad + length] = k, v
    columns = torch.arange(cache, device=backend.device)
    for t in (0, 40, length - 1):
        mask = ((columns >= pad) & (columns <= pad + t))[None, None, None]
        step = ops.attention(
            None, q[:, :, t : t + 1], keys, values, mask, position_ids=positions[:, t : t + 1]
        )[0]
        assert torch.equal(step[0, 0], full[0, t]), f"decode query {t}"
    if ops.rms_norm is not None:
        normed = ops.rms_norm(x, weight[0], 1e-6)
        assert torch.equal(ops.rms_norm(x[5:6], weight[0], 1e-6)[0], normed[5])
    if ops.log_softmax is not None:
        scores = randn(5, 3000) * 4
        dist = ops.log_softmax(scores)
        torch.testing.assert_close(dist, torch.log_softmax(scores, -1), rtol=1e-5, atol=1e-5)
        assert torch.equal(ops.log_softmax(scores[3:4])[0], dist[3])
