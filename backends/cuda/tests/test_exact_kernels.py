"""The trainer-exact Triton kernels: the reference math within tolerance, and a row's result
the same bits whatever the other rows, their number, the row's padding or the cache's length.

Off the GPU they run under Triton's interpreter (conftest.py sets ``TRITON_INTERPRET=1``) on
CPU tensors, in float32 and float16 (the interpreter cannot multiply bfloat16; bf16 is checked
on the GPU by tests/test_device_trainer_exact.py). The interpreter's products are NumPy's, so
the invariances here show the kernels' orders (tiles, key blocks anchored at position 0, the
padded query block); the GPU's MMA units are checked by the device test. The last test runs
the rollout engine's eager loop and the trainer's forward on these kernels (a CPU graph cannot
record an interpreted kernel, so the graph paths are the device test's).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the trainer-exact kernels need Triton")

from graphcap_cuda.kernels import exact
from graphcap_cuda.kernels.exact import attention, linear, log_softmax, rms_norm

from graphcap.cpu.backend import CPUBackend
from graphcap.exact_ops import ExactOps, exact_silu
from graphcap.rollout import (
    RolloutConfig,
    RolloutEngine,
    SamplingParams,
    token_logprobs,
    trainer_exact,
)
from graphcap.tiny_models import PAD, prompts, tiny_model

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    error = (got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1)
    assert error < TOLERANCE[dtype], f"relative error {error:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_product_is_the_same_bits_whatever_the_number_of_rows(dtype):
    """F.linear within tolerance; one row alone, in 37 rows and in 130 (three row tiles, the
    row in the last) gives identical bits."""
    torch.manual_seed(0)
    x, weight, bias = randn(130, 96, dtype=dtype), randn(70, 96, dtype=dtype), randn(70)
    out = linear(x, weight, bias.to(dtype))
    close(out, F.linear(x.float(), weight.float(), bias.float()), dtype)
    assert out.dtype == dtype
    for row in (0, 5, 129):
        for rows in (slice(row, row + 1), slice(max(0, row - 36), row + 1)):
            part = linear(x[rows], weight, bias.to(dtype))
            assert torch.equal(part[-1], out[row])


@pytest.mark.parametrize("depth", [600, 800])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_product_sums_its_splits_in_one_order_whoever_computes_them(dtype, depth, monkeypatch):
    """A narrow, deep weight sums over K in splits (2 at depth 600, 3 at 800, the last one
    short): a program per split (few rows, a decode step) and a program per tile summing them
    in turn (many rows, a trainer's batch) give the same bits, for a row alone too."""
    assert exact.splits(70, depth)[0] == {600: 2, 800: 3}[depth]
    torch.manual_seed(2)
    x, weight = randn(130, depth, dtype=dtype), randn(70, depth, dtype=dtype)
    spread = linear(x, weight)
    close(spread, F.linear(x.float(), weight.float()), dtype)
    alone = linear(x[129:], weight)
    monkeypatch.setattr(exact, "SPREAD_BELOW_TILES", 0)
    in_turn = linear(x, weight)
    assert torch.equal(spread, in_turn)
    assert torch.equal(alone[0], in_turn[129])
    assert not torch.equal(in_turn, linear(x[:, :-1], weight[:, :-1])), "the test reads all K"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_trainers_batch_takes_the_large_tile_and_the_same_bits(dtype, monkeypatch):
    """Rows past LARGE_TILE_ROWS take the large tile, whose sums are the small tile's: the same
    bits for a weight summed in splits (depth 600) and one that is not, the rows and columns
    not multiples of either tile."""
    torch.manual_seed(5)
    monkeypatch.setattr(exact, "SPREAD_BELOW_TILES", 0)
    for depth in (600, 96):
        x, weight = randn(300, depth, dtype=dtype), randn(200, depth, dtype=dtype)
        monkeypatch.setattr(exact, "LARGE_TILE_ROWS", 10**9)
        small = linear(x, weight)
        monkeypatch.setattr(exact, "LARGE_TILE_ROWS", 1)
        assert torch.equal(linear(x, weight), small)


def test_empty_products_are_what_f_linear_gives():
    """No rows, or an empty K (zeros), as ``F.linear`` gives them, not an error."""
    weight = randn(5, 8)
    assert linear(randn(0, 8), weight).shape == (0, 5)
    assert torch.equal(linear(randn(3, 0), randn(5, 0)), torch.zeros(3, 5, device=DEVICE))


def causal(batch: int, columns: int, starts: list[int], counts: list[int], window=None):
    """(B, 1, Q=columns, S=columns) bool: row ``b``'s real tokens at ``[starts[b],
    starts[b] + counts[b])``, causal, within ``window`` positions where given."""
    col = torch.arange(columns, device=DEVICE)
    start = torch.tensor(starts, device=DEVICE)[:, None]
    real = (col >= start) & (col < start + torch.tensor(counts, device=DEVICE)[:, None])
    allowed = real[:, None, None, :] & (col[None, None, None, :] <= col[None, None, :, None])
    if window is not None:
        allowed &= col[None, None, None, :] > col[None, None, :, None] - window
    return allowed


def positions(starts: list[int], columns: int) -> torch.Tensor:
    col = torch.arange(columns, device=DEVICE)
    return (col[None, :] - torch.tensor(starts, device=DEVICE)[:, None]).clamp(min=0)


def qkv(length: int, dtype: torch.dtype, batch: int = 1):
    return (
        randn(batch, HEADS, length, HEAD_DIM, dtype=dtype),
        randn(batch, KV_HEADS, length, HEAD_DIM, dtype=dtype),
        randn(batch, KV_HEADS, length, HEAD_DIM, dtype=dtype),
    )


def run_attention(q, k, v, mask, position_ids):
    return attention(None, q, k, v, mask, position_ids=position_ids)[0]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_softmax_attention_and_ignores_padding_and_companions(dtype, window):
    """A 70-token row (two key blocks and a part) alone, right-padded beside a longer row, and
    left-padded by 9 beside another: the same bits for every real query; softmax attention
    (grouped heads, the window) within tolerance."""
    torch.manual_seed(1)
    length, pad = 70, 9
    q, k, v = qkv(length, dtype)
    alone = run_attention(q, k, v, causal(1, length, [0], [length], window), positions([0], length))
    want = exact.softmax_attention(
        q, k, v, causal(1, length, [0], [length], window)[:, 0], HEAD_DIM**-0.5
    )
    close(alone, want, dtype)

    width = length + pad
    other = qkv(width, dtype)
    right = [torch.cat([t, torch.zeros_like(t[:, :, :pad])], 2) for t in (q, k, v)]
    left = [torch.cat([torch.ones_like(t[:, :, :pad]), t], 2) for t in (q, k, v)]
    for batch, starts, counts, at in (
        (
            [torch.cat([r, o]) for r, o in zip(right, other, strict=True)],
            [0, 0],
            [length, width],
            0,
        ),
        (
            [torch.cat([o, x]) for o, x in zip(other, left, strict=True)],
            [0, pad],
            [width, length],
            1,
        ),
    ):
        mask = causal(2, width, starts, counts, window)
        out = run_attention(*batch, mask, positions(starts, width))
        first = starts[at]
        assert torch.equal(out[at, first : first + length], alone[0])


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_query_reading_a_cache_equals_the_same_position_in_the_full_forward(dtype, window):
    """Query ``t`` alone (a decode step) against a left-padded cache of 200 columns, beside a
    row at another length, equals query ``t`` of the full causal forward, at block edges too."""
    torch.manual_seed(2)
    length, pad, cache = 70, 9, 200
    q, k, v = qkv(length, dtype)
    full = run_attention(q, k, v, causal(1, length, [0], [length], window), positions([0], length))
    keys, values = (
        torch.zeros(2, KV_HEADS, cache, HEAD_DIM, device=DEVICE, dtype=dtype) for _ in "kv"
    )
    keys[0, :, pad : pad + length], values[0, :, pad : pad + length] = k[0], v[0]
    keys[1], values[1] = (randn(KV_HEADS, cache, HEAD_DIM, dtype=dtype) for _ in "kv")
    col = torch.arange(cache, device=DEVICE)
    for t in (0, 5, 63, 64, 69):
        mask = torch.zeros(2, 1, 1, cache, dtype=torch.bool, device=DEVICE)
        mask[0, 0, 0] = (col >= pad) & (col <= pad + t)
        mask[1, 0, 0] = col <= 150
        if window is not None:
            mask[0, 0, 0] &= col > pad + t - window
        query = torch.cat([q[:, :, t : t + 1], randn(1, HEADS, 1, HEAD_DIM, dtype=dtype)])
        out = run_attention(query, keys, values, mask, torch.tensor([[t], [150]], device=DEVICE))
        assert torch.equal(out[0, 0], full[0, t]), t


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_log_softmax_are_row_kernels(dtype):
    """The models' RMSNorm and log_softmax within tolerance; a row alone equals the same row
    among others."""
    torch.manual_seed(3)
    x, weight = randn(37, 96, dtype=dtype), randn(96, dtype=dtype)
    out = rms_norm(x, weight, 1e-6)
    close(out, exact._norm_reference(x, weight, 1e-6), dtype)
    assert torch.equal(rms_norm(x[20:21], weight, 1e-6)[0], out[20])
    scores = randn(5, 9000) * 4
    dist = log_softmax(scores)
    close(dist, torch.log_softmax(scores, -1), torch.float32)
    assert torch.equal(log_softmax(scores[3:4])[0], dist[3])


def test_gradients_agree_with_torchs():
    """Each kernel's backward equals torch's autograd of the reference math (float32), a
    left-padded row's queries of no keys included."""
    torch.manual_seed(4)

    def grads(function, *inputs):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = function(*leaves)
        noise = torch.Generator(DEVICE).manual_seed(9)
        out.backward(torch.randn(out.shape, generator=noise, device=DEVICE))
        return [leaf.grad for leaf in leaves]

    x, weight = randn(6, 32), randn(24, 32)
    for got, want in zip(grads(linear, x, weight), grads(F.linear, x, weight), strict=True):
        close(got, want, torch.float32)
    for got, want in zip(
        grads(lambda a, w: rms_norm(a, w, 1e-6), x, weight[0]),
        grads(lambda a, w: exact._norm_reference(a, w, 1e-6), x, weight[0]),
        strict=True,
    ):
        close(got, want, torch.float32)
    got, want = grads(log_softmax, x), grads(lambda a: torch.log_softmax(a, -1), x)
    close(got[0], want[0], torch.float32)
    q, k, v = qkv(20, torch.float32, batch=2)
    mask = causal(2, 20, [0, 5], [20, 15])  # the second row's first 5 queries attend no key
    for got, want in zip(
        grads(lambda *t: run_attention(*t, mask, positions([0, 5], 20)), q, k, v),
        grads(lambda *t: exact.softmax_attention(*t, mask[:, 0], HEAD_DIM**-0.5), q, k, v),
        strict=True,
    ):
        close(got, want, torch.float32)


class KernelBackend(CPUBackend):
    """The CPU reference backend serving the CUDA plugin's trainer-exact kernels. The
    elementwise operations around them are the CPU's, whose SiLU rounds a vectorised loop's
    tail differently (decision 85), so SiLU is the reference's here; the GPU keeps torch's."""

    def exact_ops(self) -> ExactOps:
        return dataclasses.replace(exact.OPS, silu=exact_silu)


@pytest.mark.skipif(
    not INTERPRETED, reason="the GPU runs this in tests/test_device_trainer_exact.py"
)
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_the_engines_logprobs_equal_the_trainers_on_these_kernels(family):
    """The eager loop (float32, left-padded prompts, rows at different lengths) records the
    log-probs the trainer's forward gives, right- and left-padded, bit for bit."""
    overrides = {"mistral": {"sliding_window": 5}, "qwen3": {"intermediate_size": 100}}
    model = tiny_model(family, **overrides.get(family, {}))
    backend = KernelBackend()
    engine = RolloutEngine(
        model, RolloutConfig(trainer_exact=True, enable_graph_capture=False, backend=backend)
    )
    ids, mask = prompts(3, 7)
    params = SamplingParams(
        max_new_tokens=6, do_sample=True, seed=5, return_logprobs=True, logprobs_mode="raw"
    )
    result = engine.generate(ids, mask, params)
    rows = []
    for row, response in zip(result.sequences.tolist(), result.response_mask.tolist(), strict=True):
        prompt = [t for t in row[:7] if t != PAD]
        rows.append(prompt + [t for t, m in zip(row[7:], response, strict=False) if m])
    width = max(len(r) for r in rows)
    for side in ("right", "left"):
        tokens = torch.full((len(rows), width), PAD)
        attend = torch.zeros_like(tokens)
        for i, row in enumerate(rows):
            at = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
            tokens[i, at], attend[i, at] = torch.tensor(row), 1
        with torch.no_grad(), trainer_exact(model, backend):
            logits = model(tokens, attention_mask=attend).logits
        for i, (row, n) in enumerate(zip(rows, result.response_lengths.tolist(), strict=True)):
            end = len(row) if side == "right" else width
            want = token_logprobs(
                logits[i, end - n - 1 : end - 1], tokens[i, end - n : end], backend=backend
            )
            got = result.logprobs[i][result.response_mask[i].bool()]
            assert torch.equal(got, want), f"{side}-padded row {i}"


@pytest.mark.skipif(not INTERPRETED, reason="a CPU model on the interpreted kernels")
def test_a_forwards_layers_share_one_analysis_of_their_mask(monkeypatch):
    """The mask's origins and reaches are derived once a forward (a captured decode step runs
    that once, not once a layer), again for the next forward, and the logits are the same
    bits as when every layer derives its own."""
    model = tiny_model("llama", num_hidden_layers=3)
    backend = KernelBackend()
    ids, mask = prompts(2, 7)
    derived = []
    row_origin = exact.row_origin

    def counted(*args, **kwargs):
        derived.append(1)
        return row_origin(*args, **kwargs)

    def logits():
        with torch.no_grad(), trainer_exact(model, backend):
            return model(ids, attention_mask=mask).logits

    monkeypatch.setattr(exact, "row_origin", counted)
    shared = [logits(), logits()]
    assert len(derived) == 2
    monkeypatch.setattr(exact, "per_forward", lambda objects, details, compute: compute())
    each_layer = logits()
    assert len(derived) == 2 + 3
    assert torch.equal(shared[0], shared[1]) and torch.equal(shared[0], each_layer)
