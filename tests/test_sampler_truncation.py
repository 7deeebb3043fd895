"""Top-k, top-p and min-p without a vocabulary sort, against the sort they replace.

``sorted_truncation`` is the sampler's former implementation (one ascending sort serving top-k
and top-p, then a cumulative sum and a scatter), kept here as the oracle: it keeps exactly the
set transformers' warpers keep (``test_rollout_units.py`` checks the sampler against those).
The search must give the same scores on every row; where the cut falls within float rounding
of the mass, or inside a group of equal values, only tokens at that cut may differ.
"""

from __future__ import annotations

import pytest
import torch
from rollout_models import tiny_model

from graphcap import tiny_models
from graphcap.cpu import CPUBackend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.sampling import RowSettings, sanitise, truncated

pytestmark = pytest.mark.filterwarnings("error::graphcap.rollout.CaptureFallbackWarning")

NEG_INF = -float("inf")
VOCABS = [97, 1000, 50257, 128256]


def sorted_truncation(scores: torch.Tensor, rows: RowSettings) -> torch.Tensor:
    """The former sort-based top-k, top-p, min-p (the oracle)."""
    vocab = scores.shape[-1]
    ordered, order = torch.sort(scores, descending=False)
    k = rows.top_k.clamp(max=vocab)
    kth = ordered.gather(1, (vocab - k.clamp(min=1))[:, None])
    use_k = (k > 0)[:, None]
    scores = scores.masked_fill(use_k & (scores < kth), NEG_INF)
    ordered = ordered.masked_fill(use_k & (ordered < kth), NEG_INF)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= rows.top_p_floor[:, None]
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    scores = scores.masked_fill(remove & (rows.top_p_floor > 0)[:, None], NEG_INF)
    probs = scores.softmax(dim=-1)
    below = probs < rows.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return scores.masked_fill(below, NEG_INF)


def settings(params: list[dict], vocab: int) -> RowSettings:
    rows = RowSettings.allocate(len(params), vocab, torch.device("cpu"))
    rows.write([SamplingParams(do_sample=True, **p) for p in params], [0] * len(params))
    return rows


def both(scores: torch.Tensor, params: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = settings(params, scores.shape[-1])
    return truncated(scores, rows), sorted_truncation(scores, rows)


def cumulative_mass(scores: torch.Tensor, kept_by_k: torch.Tensor) -> torch.Tensor:
    """Per token, in float64, the mass (among ``kept_by_k``) of tokens at or below it."""
    probs = torch.where(kept_by_k, scores.double(), NEG_INF).softmax(dim=-1)
    return torch.stack([probs[scores <= value].sum() for value in scores])


def assert_same_but_at_the_cut(got: torch.Tensor, expected: torch.Tensor, scores, params, tol):
    """Rows equal, except tokens at a top-p cut: all of one value the search keeps whole
    (ties), or tokens whose float64 mass at or below them is within ``tol`` of ``1 - top_p``
    (rounding). Returns how many rows differed."""
    differing = 0
    for row, p in enumerate(params):
        if torch.equal(got[row], expected[row]):
            continue
        differing += 1
        assert p.get("top_p", 1.0) < 1.0 and not p.get("min_p"), f"row {row} {p}"
        where = (got[row] != expected[row]).nonzero()[:, 0]
        values = scores[row, where]
        if (values == values[0]).all() and (scores[row] == values[0]).sum() > 1:
            # one group of equal values, which the search keeps whole
            assert (got[row, where] == values).all(), f"row {row}: the search drops a tie"
            continue
        k = p.get("top_k", 0)
        kept_by_k = scores[row] >= scores[row].topk(k).values[-1] if k else scores[row] > NEG_INF
        mass = cumulative_mass(scores[row], kept_by_k)[where]
        floor = 1.0 - p["top_p"]
        assert ((mass - floor).abs() <= tol).all(), f"row {row}: {mass.tolist()} vs {floor}"
    return differing


# ---- distributions with a clear cut: the same scores, bit for bit ----------------------------
MIXED_ROWS = [
    {"top_k": 1},
    {"top_k": 7},
    {"top_k": 50, "top_p": 0.9},
    {"top_p": 0.95},
    {"top_p": 0.3},
    {"min_p": 0.05},
    {"top_k": 20, "top_p": 0.8, "min_p": 0.02},
    {},  # sampled, nothing truncated: untouched
    {"top_k": 10**9},
    {"top_p": 0.999999},
    {"top_p": 1e-6},
]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0, 30.0])
def test_mixed_settings_equal_the_sort_on_random_rows(vocab, scale):
    """One batch mixing every setting (each row its own), for vocabularies that are no
    multiple of any block size and distributions from near-flat to peaked."""
    rows = MIXED_ROWS if vocab < 50000 else MIXED_ROWS[1:5] + MIXED_ROWS[6:7]
    generator = torch.Generator().manual_seed(vocab + int(scale * 10))
    scores = torch.randn(len(rows), vocab, generator=generator) * scale
    got, expected = both(scores, rows)
    assert torch.equal(got, expected)
    if {} in rows:
        assert torch.equal(got[rows.index({})], scores[rows.index({})])


@pytest.mark.parametrize("vocab", [97, 1000])
def test_top_k_at_every_rank_equals_the_sort(vocab):
    """Top-k's threshold is the exact k-th value for every k, k >= V included (ties included:
    integers repeat, and zeros of both signs)."""
    generator = torch.Generator().manual_seed(vocab)
    ks = list(range(1, vocab + 3))
    scores = torch.randint(-20, 20, (len(ks), vocab), generator=generator).float()
    scores[1::4] = -scores[1::4]  # -0.0 beside +0.0: equal values, distinct bit patterns
    scores[::2] = torch.randn(len(ks[::2]), vocab, generator=generator)
    got, expected = both(scores, [{"top_k": k} for k in ks])
    assert torch.equal(got, expected)


def test_one_hot_and_masked_rows_equal_the_sort():
    """One-hot rows, -inf columns (penalties, min_new_tokens blocks), a row with one finite
    score, rows with few finite scores under a large top-k, and a row of -inf."""
    vocab = 1000
    generator = torch.Generator().manual_seed(5)
    scores = torch.randn(8, vocab, generator=generator) * 3
    scores[0] = -30.0
    scores[0, 17] = 30.0  # one-hot, finite
    scores[1] = NEG_INF
    scores[1, 3] = 0.5  # one finite score
    scores[2, ::2] = NEG_INF  # half the vocabulary blocked
    scores[3, 5:] = NEG_INF  # fewer finite scores than top-k
    scores[4, :-1] = NEG_INF  # only the last column
    scores[5] = NEG_INF  # nothing finite (sanitise flattens it)
    scores[6, 100:900] = NEG_INF
    scores[7, torch.randperm(vocab, generator=generator)[:600]] = NEG_INF
    params = [
        {"top_p": 0.5},
        {"top_k": 5, "top_p": 0.1},
        {"top_k": 40, "top_p": 0.9},
        {"top_k": 50},
        {"top_p": 0.2, "min_p": 0.5},
        {"top_k": 3, "top_p": 0.5},
        {"top_p": 0.99},
        {"top_k": 300, "top_p": 0.7, "min_p": 0.01},
    ]
    got, expected = both(scores, params)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("temperature", [1e-4, 1e-2, 1e2, 1e4])
def test_tiny_and_huge_temperatures_match_the_sort_but_at_the_cut(temperature):
    """Scores divided by the temperature, as warp does: tiny temperatures make one token
    dominate (or overflow to inf), huge ones make the row nearly flat, where a token's mass is
    of the order of the cumulative sum's rounding, so a token at the cut may go either way."""
    vocab = 50257
    generator = torch.Generator().manual_seed(int(temperature * 100))
    logits = torch.randn(6, vocab, generator=generator) * 5
    scores = logits / temperature
    params = [
        {"top_p": 0.9},
        {"top_k": 50},
        {"top_k": 1000, "top_p": 0.5},
        {"top_p": 0.05},
        {"top_p": 0.999},
        {"top_k": 7, "top_p": 0.95},
    ]
    got, expected = both(scores, params)
    assert assert_same_but_at_the_cut(got, expected, scores, params, tol=1e-4) <= 2


# ---- ties and rounding at the cut -------------------------------------------------------------
def test_flat_rows_keep_the_whole_tie_where_the_sort_cuts_it():
    """A flat row is one tie: top-k keeps it all as the sort does; top-p keeps it all where
    the sort keeps the part it happened to order last (ties aside)."""
    vocab = 1000
    scores = torch.full((4, vocab), 0.25)
    params = [{"top_k": 10}, {"top_p": 0.5}, {"top_k": 10, "top_p": 0.5}, {"min_p": 0.9}]
    got, expected = both(scores, params)
    assert torch.equal(got, scores)  # the whole tie, in every row
    assert torch.equal(expected[[0, 3]], scores[[0, 3]])
    for row in (1, 2):  # the part the sort happened to order last
        assert 0 < (expected[row] == NEG_INF).sum() < vocab
    assert assert_same_but_at_the_cut(got, expected, scores, params, tol=0) == 2


def test_a_tie_at_the_cut_is_kept_whole():
    """Three equal scores straddle the top-p cut; everything else is far from it."""
    vocab = 97
    scores = torch.full((2, vocab), -20.0)
    scores[:, :5] = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0])
    params = [{"top_p": 0.6}, {"top_k": 3}]
    got, expected = both(scores, params)
    probs = scores[0].softmax(-1)
    assert probs[0] < 0.6 < probs[:2].sum()  # the cut falls inside the tie
    assert torch.equal(got[0, :4], scores[0, :4]) and (got[0, 4:] == NEG_INF).all()
    assert torch.equal(got[1], expected[1]) and torch.equal(got[1, :4], scores[1, :4])
    assert assert_same_but_at_the_cut(got, expected, scores, params, tol=0) <= 1


def test_a_cut_within_rounding_differs_by_at_most_that_token():
    """Masses built so that the cut lands on a float-rounding boundary: ``1 - top_p`` equal
    to the mass below a token up to the last bits. Only that token may differ."""
    vocab = 1000
    generator = torch.Generator().manual_seed(2)
    scores = torch.randn(16, vocab, generator=generator)
    params = []
    for row in range(16):
        probs = scores[row].double().softmax(-1)
        ordered = probs.sort().values.cumsum(-1)
        floor = float(ordered[200 + 40 * row])  # exactly the mass up to a token
        params.append({"top_p": 1.0 - floor})
    got, expected = both(scores, params)
    assert assert_same_but_at_the_cut(got, expected, scores, params, tol=1e-5) <= 16
    for row in range(16):
        assert (got[row] != expected[row]).sum() <= 1


# ---- rows the draw sanitises: the draw stays what it was --------------------------------------
def test_inf_and_nan_rows_sanitise_to_the_same_draw():
    """+inf scores (a tiny temperature overflowing) draw among the +inf tokens; NaN rows draw
    flat. What the search leaves there sanitises to what the sort left."""
    vocab = 1000
    generator = torch.Generator().manual_seed(9)
    scores = torch.randn(6, vocab, generator=generator)
    scores[0, [3, 500]] = float("inf")
    scores[1, 7] = float("inf")
    scores[2, 11] = float("nan")
    scores[3, :] = float("nan")
    scores[4, [1, 2]] = float("inf")
    scores[4, 900:] = NEG_INF
    scores[5, 9] = float("inf")
    scores[5, 10] = float("nan")
    params = [
        {"top_p": 0.9},
        {"top_k": 5, "top_p": 0.5, "min_p": 0.1},
        {"top_k": 5},
        {"top_p": 0.5},
        {"top_k": 1},
        {"min_p": 0.2},
    ]
    got, expected = both(scores, params)
    finished = torch.zeros(6, dtype=torch.bool)
    assert torch.equal(sanitise(got, finished), sanitise(expected, finished))
    assert torch.isposinf(got[0, [3, 500]]).all() and torch.isposinf(got[4, [1, 2]]).all()


# ---- compiled: the fused reductions ----------------------------------------------------------
def test_compiled_search_equals_the_eager_search():
    """Under torch.compile the search sums each bucket by its own reduction (which inductor
    fuses into one read per pass) where eager code scatters into the buckets: integer sums,
    so the two give the same scores. Traced whole (no graph break: no host read), run by
    dynamo's eager backend so the trace itself is what is checked."""
    vocab = 1000
    generator = torch.Generator().manual_seed(12)
    scores = torch.randn(len(MIXED_ROWS), vocab, generator=generator) * 3
    scores[0, 5] = scores[0, 6] = scores[0].max()  # a tie at the top
    scores[3, ::3] = NEG_INF
    rows = settings(MIXED_ROWS, vocab)
    torch._dynamo.reset()
    compiled = torch.compile(truncated, backend="eager", fullgraph=True)
    got = compiled(scores, rows)
    assert torch.equal(got, truncated(scores, rows))
    assert torch.equal(got, sorted_truncation(scores, rows))


# ---- in a captured step -----------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [97, 1000])
def test_captured_truncating_step_equals_eager(vocab):
    """Rows mixing top-k, top-p, min-p and none in one batch: the captured step on the CPU
    reference backend (no host read, no data-dependent shape) equals the eager loop."""
    model = tiny_model("llama", vocab_size=vocab)
    ids, mask = tiny_models.prompts(5, 6, seed=4, vocab_size=vocab)
    base = {"do_sample": True, "max_new_tokens": 6, "eos_token_id": [], "seed": 3}
    params = [
        SamplingParams(**base, top_k=5),
        SamplingParams(**base, top_p=0.7, temperature=0.8),
        SamplingParams(**base, top_k=40, top_p=0.9, min_p=0.05),
        SamplingParams(**base, min_p=0.1, temperature=1.5),
        SamplingParams(**base),
    ]
    results = {}
    for graph in (True, False):
        config = RolloutConfig(enable_graph_capture=graph, backend=CPUBackend())
        results[graph] = RolloutEngine(model, config).generate(ids, mask, params)
    assert results[True].stats.path == "static_graph" and results[True].stats.captures == 1
    assert torch.equal(results[True].sequences, results[False].sequences)
