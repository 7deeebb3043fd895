"""The fused truncation-and-draw kernel keeps generate's set and draws the reference's tokens.

Off the GPU it runs under Triton's interpreter (conftest.py sets ``TRITON_INTERPRET=1``), on CPU
tensors; the reference is graphcap.rollout.sampling's PyTorch math (a sort per truncated row).
Rows are adversarial: flat, one-hot, ties at the cut, +-inf and NaN, fewer finite values than
top-k, vocabularies that are not a multiple of the kernel's block.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the sampler kernel needs Triton (CUDA builds ship it)")

from graphcap_cuda.kernels import sampler
from graphcap_cuda.kernels.sampler import truncated_draw

from graphcap.rollout.sampling import RowSettings, SamplerShape, select, truncated
from graphcap.rollout.settings.sampling_params import SamplingParams

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
NEG = -float("inf")

#: Settings each test row may take (keyed rows: ``seed`` set).
SETTINGS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 7},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 1.3, "min_p": 0.05},
    {"temperature": 1.0, "top_k": 40, "top_p": 0.8},
    {"temperature": 0.8, "top_k": 20, "top_p": 0.95, "min_p": 0.02},
    {"temperature": 1.0, "top_p": 0.3},
    {"temperature": 2.0, "top_k": 1},
]


def _rows(params: list[SamplingParams], vocab: int) -> RowSettings:
    rows = RowSettings.allocate(len(params), vocab, torch.device(DEVICE))
    rows.write(params, [0] * len(params))
    return rows


def _kernel(scores, rows, finished, generated):
    return truncated_draw(
        scores,
        rows.temperature,
        rows.top_k,
        rows.top_p_floor,
        rows.min_p,
        rows.sample,
        rows.seeded,
        rows.key,
        finished,
        generated,
    )


def _reference(scores, rows, finished, generated):
    """The core's tokens (keyed rows' draws, others' argmax) and each row's kept set."""
    shape = SamplerShape(samples=True, truncates=True, keyed=True)
    tokens = select(scores, rows, finished, generated, None, shape).tokens
    kept = truncated(scores / rows.temperature[:, None], rows) > NEG
    return tokens, kept


def _check(scores, params, finished=None, generated=3, ties=()):
    """Kernel against reference: tokens of live rows; the kept set of sampled rows with
    finite scores. ``ties``: rows whose top-p cut falls among equal values, where the kernel
    keeps them all and generate's sort some (so the draws differ too)."""
    batch, vocab = scores.shape
    scores = scores.to(DEVICE)
    rows = _rows(params, vocab)
    finished = torch.zeros(batch, dtype=torch.bool) if finished is None else finished
    finished = finished.to(DEVICE)
    generated = torch.tensor([generated], device=DEVICE)
    tokens, cut = _kernel(scores, rows, finished, generated)
    expected, kept = _reference(scores, rows, finished, generated)
    compared = ~finished
    compared[list(ties)] = False
    assert torch.equal(tokens[compared], expected[compared]), (tokens, expected)
    scaled = scores / rows.temperature[:, None]
    ours = (scaled >= cut[:, None]) & (scaled > NEG)
    for b, p in enumerate(params):
        if not p.do_sample or finished[b] or not torch.isfinite(scores[b]).any():
            continue
        if torch.isnan(scores[b]).any() or torch.isposinf(scores[b]).any():
            continue
        if b in ties:  # a draw from the kernel's own set
            assert (ours[b] >= kept[b]).all() and ours[b, tokens[b]]
            assert scaled[b][ours[b] != kept[b]].unique().numel() <= 1
        else:
            assert torch.equal(ours[b], kept[b]), (b, p, ours[b].sum(), kept[b].sum())
    return tokens, cut


@pytest.mark.parametrize("vocab", [37, sampler.BLOCK, 1537, 3000])
def test_random_rows_match_the_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    params = [SamplingParams(do_sample=True, seed=11 + i, **s) for i, s in enumerate(SETTINGS)]
    scores = torch.randn(len(params), vocab, generator=gen) * 3
    scores[1, : vocab // 3] = NEG  # masked tokens
    _check(scores, params)


def test_draws_follow_the_step_counter_and_key():
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(do_sample=True, seed=5, top_k=50)] * 4
    scores = torch.randn(4, 600, generator=gen).expand(4, 600).contiguous()
    drawn = {tuple(_check(scores, params, generated=g)[0].tolist()) for g in range(6)}
    assert len(drawn) > 1


@pytest.mark.parametrize("setting", SETTINGS)
def test_flat_and_one_hot_rows(setting):
    vocab = 700
    flat = torch.zeros(vocab)
    one_hot = torch.full((vocab,), -5.0)
    one_hot[123] = 9.0
    only = torch.full((vocab,), NEG)
    only[600] = 1.0
    scores = torch.stack([flat, one_hot, only])
    params = [SamplingParams(do_sample=True, seed=3 + i, **setting) for i in range(3)]
    top_p = setting.get("top_p", 1.0) < 1.0
    _check(scores, params, ties=(0,) if top_p else ())


def test_ties_at_the_cut():
    vocab = 900
    scores = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    scores[:, 10:20] = 6.0  # ten tokens tie above the rest
    scores[:, 5] = 8.0
    params = [
        SamplingParams(do_sample=True, seed=1, top_k=3),  # the cut among the ties: all kept
        SamplingParams(do_sample=True, seed=2, top_k=11),
        SamplingParams(do_sample=True, seed=3, top_p=0.5),
        SamplingParams(do_sample=True, seed=4, top_k=5, min_p=0.5),
    ]
    _, cut = _check(scores, params, ties=(2,))
    assert cut[0] == cut[1] == 6.0


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's NumPy
def test_infinities_nan_and_finished_rows():
    vocab = 1100
    scores = torch.randn(7, vocab, generator=torch.Generator().manual_seed(2))
    scores[0, [3, 900]] = float("inf")  # overflowed: a draw among the +inf tokens
    scores[1, 17] = float("nan")  # a diverged row: uniform
    scores[2] = NEG  # nothing finite: uniform
    scores[3, 40:] = NEG  # fewer finite values than top-k
    scores[4, 50] = float("nan")  # greedy with a NaN: argmax is the NaN's column
    scores[6] = -1e38  # underflows to -inf at a tiny temperature: the argmax tokens
    scores[6, [8, 1000]] = -1e37
    params = [
        SamplingParams(do_sample=True, seed=1, top_k=4),
        SamplingParams(do_sample=True, seed=2, top_p=0.9),
        SamplingParams(do_sample=True, seed=3, min_p=0.1),
        SamplingParams(do_sample=True, seed=4, top_k=100, top_p=0.99),
        SamplingParams(),
        SamplingParams(do_sample=True, seed=6, top_k=3),
        SamplingParams(do_sample=True, seed=7, temperature=1e-3),
    ]
    finished = torch.zeros(7, dtype=torch.bool)
    finished[5] = True
    tokens, cut = _check(scores, params, finished=finished)
    assert tokens[0].item() in (3, 900) and tokens[4].item() == 50
    assert tokens[6].item() in (8, 1000)
    assert torch.isnan(cut[1]) and not torch.isnan(cut[[0, 2, 3]]).any()


def test_unseeded_rows_get_the_cut_and_greedy_rows_the_argmax():
    """Rows drawing from the shared generator take the reference's draw over the kept set the
    cut gives; their token here is the argmax (the core replaces it)."""
    vocab = 2000
    scores = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)) * 2
    params = [
        SamplingParams(do_sample=True, top_k=10, top_p=0.7),
        SamplingParams(do_sample=True, min_p=0.2),
        SamplingParams(),
    ]
    rows = _rows(params, vocab)
    scores = scores.to(DEVICE)
    finished = torch.zeros(3, dtype=torch.bool, device=DEVICE)
    tokens, cut = _kernel(scores, rows, finished, torch.tensor([0], device=DEVICE))
    assert torch.equal(tokens, scores.argmax(-1))
    scaled = scores / rows.temperature[:, None]
    kept = truncated(scaled, rows) > NEG
    assert torch.equal(scaled[:2] >= cut[:2, None], kept[:2])
    assert cut[2] == NEG


def test_per_row_counters():
    """The continuous path's step counter is one per row."""
    vocab = 800
    scores = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    params = [SamplingParams(do_sample=True, seed=9, top_k=30)] * 3
    rows = _rows(params, vocab)
    finished = torch.zeros(3, dtype=torch.bool, device=DEVICE)
    generated = torch.tensor([0, 5, 9], device=DEVICE)
    tokens, _ = _kernel(scores, rows, finished, generated)
    expected, _ = _reference(scores, rows, finished, generated)
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("value_passes", [0, 1])
def test_key_spaced_passes_find_the_same_cut(value_passes, monkeypatch):
    """Rows whose values crowd within a few ulps defeat thresholds spaced by value: the
    passes spaced by integer key still end on the exact cut."""
    monkeypatch.setattr(sampler, "VALUE_PASSES", value_passes)
    vocab = 1300
    gen = torch.Generator().manual_seed(5)
    crowded = 1.0 + torch.randint(0, 64, (vocab,), generator=gen) * 2.0**-23
    spread = torch.randn(vocab, generator=gen) * 4
    scores = torch.stack([crowded, spread, crowded, spread])
    params = [
        SamplingParams(do_sample=True, seed=1, top_k=100),
        SamplingParams(do_sample=True, seed=2, top_k=60, top_p=0.9),
        SamplingParams(do_sample=True, seed=3, top_k=700),
        SamplingParams(do_sample=True, seed=4, top_p=0.6),
    ]
    _check(scores, params)


@pytest.mark.skipif(not INTERPRETED, reason="CPU models need the interpreter")
@pytest.mark.parametrize("draws", ["per_row", "generate"])
def test_captured_steps_with_the_kernel_draw_the_reference_tokens(draws):
    """The engine on a backend offering the kernel (the CPU one, interpreted): captured steps
    choose the tokens and log-probs that the core's math chooses eagerly, keyed or drawn from
    the shared generator, with one graph for truncating and plain calls alike."""
    from graphcap.cpu import CPUBackend
    from graphcap.rollout import RolloutConfig, RolloutEngine
    from graphcap.tiny_models import prompts, tiny_model

    model = tiny_model("llama")
    ids, mask = prompts(3, width=5)
    backend = type(
        "FusedSamplerBackend", (CPUBackend,), {"truncated_draw": lambda self: truncated_draw}
    )()
    fused = RolloutEngine(
        model, RolloutConfig(backend=backend, enable_graph_capture=True, draws=draws)
    )
    reference = RolloutEngine(
        model, RolloutConfig(backend=CPUBackend(), enable_graph_capture=False, draws=draws)
    )
    base = {"do_sample": True, "max_new_tokens": 6, "eos_token_id": [], "return_logprobs": True}
    calls = [{"top_k": 20, "top_p": 0.9}, {"temperature": 0.8}, {"min_p": 0.05, "temperature": 1.5}]
    for i, change in enumerate(calls):
        params = SamplingParams(**base, **change)
        torch.manual_seed(i)
        got = fused.generate(ids, mask, params)
        torch.manual_seed(i)
        expected = reference.generate(ids, mask, params)
        assert got.stats.path == "static_graph", got.stats.fallback_reason
        assert torch.equal(got.sequences, expected.sequences), change
        torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-5, atol=1e-5)
        assert "truncates" not in got.stats.sampler_shape
    assert got.stats.captures == 1


@pytest.mark.skipif(not INTERPRETED, reason="the CPU backend needs the interpreter")
def test_the_conformance_check_passes_with_the_kernel():
    from graphcap.cpu import CPUBackend
    from graphcap.testing.conformance.test_capabilities import (
        test_truncated_draw_matches_the_reference,
    )

    fused = {"truncated_draw": lambda self: truncated_draw}
    test_truncated_draw_matches_the_reference(type("FusedSampler", (CPUBackend,), fused)())


#: Small chunks (two blocks of 64 columns, searched 32 at a time), so that short test rows
#: span several chunks.
SPLIT = {"BLOCK": 64, "CHUNK_BLOCKS": 2, "SEARCH_BLOCK": 32}


def _adversarial_rows(vocab: int) -> tuple[torch.Tensor, list[SamplingParams], tuple[int, ...]]:
    """Rows whose decisive values sit where a split can go wrong: the maximum, the cut or the
    winner in the last (partial) chunk, ties across a chunk border, NaN in the last column.
    Returns the scores, the settings and the rows whose top-p cut falls among ties."""
    chunk = SPLIT["BLOCK"] * SPLIT["CHUNK_BLOCKS"]
    gen = torch.Generator().manual_seed(vocab)
    scores = torch.randn(9, vocab, generator=gen)
    last = vocab - 1
    scores[0, last - 2] = 20.0  # the maximum in the last chunk
    scores[1, last - 9 : last] = 10.0 + torch.arange(9) * 1e-3  # kept only there
    border = min(chunk, vocab // 2)
    scores[2, border - 8 : border + 8] = 7.0  # ties across a chunk border, cut among them
    scores[3, [border + 3, 5, border - 1]] = 9.0  # a greedy row: the first of equal maxima
    scores[4, last] = float("nan")  # greedy: the NaN's column
    scores[5] = 0.0  # flat: top-p's cut among ties
    scores[6, last - 20 :] += 6.0  # min-p keeps the tail only
    scores[8, border - 1 : border + 1] = 30.0  # the winner one of two either side of it
    params = [
        SamplingParams(do_sample=True, seed=1, top_k=3),
        SamplingParams(do_sample=True, seed=2, top_p=0.5),
        SamplingParams(do_sample=True, seed=3, top_k=5, temperature=0.9),
        SamplingParams(),
        SamplingParams(),
        SamplingParams(do_sample=True, seed=6, top_p=0.7),
        SamplingParams(do_sample=True, seed=7, min_p=0.1, temperature=1.5),
        SamplingParams(do_sample=True, seed=8, top_k=60, top_p=0.9),
        SamplingParams(do_sample=True, seed=9),  # temperature alone: drawn in pass 1
    ]
    return scores, params, (5,)


@pytest.mark.parametrize(
    ("vocab", "launches", "gather"),
    [
        (100, 6, 2048),  # shorter than one chunk; searches end among gathered tokens
        (677, 6, 2048),  # a partial last chunk
        (677, 6, 0),  # never gathering: split passes, then the split draw
        (640, 1, 0),  # whole chunks; searches the split passes leave end on one program
    ],
)
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's NumPy
def test_rows_split_over_chunks_match_the_reference(vocab, launches, gather, monkeypatch):
    for name, value in SPLIT.items():
        monkeypatch.setattr(sampler, name, value)
    monkeypatch.setattr(sampler, "SEARCH_LAUNCHES", launches)
    monkeypatch.setattr(sampler, "GATHER", gather)
    scores, params, ties = _adversarial_rows(vocab)
    tokens, _ = _check(scores, params, ties=ties)
    assert tokens[0] == vocab - 3 and tokens[3] == 5 and tokens[4] == vocab - 1
    assert vocab - 10 <= tokens[1] < vocab - 1
    border = min(128, vocab // 2)
    assert tokens[8] in (border - 1, border)  # the two tied maxima either side of a border


def test_one_live_row_among_finished_rows(monkeypatch):
    """Finished rows read nothing and write pad; the live row's chunks combine alone."""
    for name, value in SPLIT.items():
        monkeypatch.setattr(sampler, name, value)
    vocab = 500
    scores = torch.randn(6, vocab, generator=torch.Generator().manual_seed(7))
    scores[3, 480] = 12.0
    params = [SamplingParams(do_sample=True, seed=i, top_k=4, top_p=0.9) for i in range(6)]
    finished = torch.ones(6, dtype=torch.bool)
    finished[3] = False
    tokens, cut = _check(scores, params, finished=finished)
    assert tokens.tolist() == [0, 0, 0, 480, 0, 0]
    assert cut[finished].eq(NEG).all() and cut[3] > NEG
