"""Truncation (top-k, top-p, min-p) and the keyed draw of a decode step in one Triton kernel,
without sorting the vocabulary.

One program per row reads the row's float32 scores a few times:

1. the row's extremes: the first maximum (greedy rows' token; a NaN's column wins, as in
   ``torch.argmax``), the largest and smallest finite temperature-scaled scores, NaN.
2. a threshold search per active truncation. The kept set of top-k, of top-p (after top-k)
   and of min-p is an upper set of the row's values, so each is one cut: the largest
   threshold ``t`` with ``count(s >= t) >= k`` (top-k), then with
   ``mass(cut_k <= s < t) <= (1 - top_p) * mass(s >= cut_k)`` (top-p, the ascending
   cumulative sum that ``generate`` compares with ``1 - top_p``). A pass tests
   :data:`PIVOTS` thresholds at once and keeps the interval between the last that holds and
   the first that does not: spaced by value for the first :data:`VALUE_PASSES` passes (few
   passes on logits), then by the float's integer key (at most eight more for any row),
   snapped to the values inside. It stops when one value is left in the interval.
3. the draw, for rows with a key: Gumbel-max over the kept tokens with the noise of
   :func:`graphcap.rollout.sampling.gumbel` (the same counter-based hash stream, computed per
   token here instead of read from a (B, V) tensor), and the smallest kept score (the cut).

Rows are classified as :func:`graphcap.rollout.sampling.sanitise` does: a row holding NaN, or
with nothing finite, draws uniformly over the vocabulary; a row whose scaled scores overflowed
(or all underflowed to ``-inf``) draws among the tokens of its largest score. Finished rows
are not read (the step writes pad for them).

It returns each row's token (the draw for keyed sampled rows, the first maximum for the
others) and its cut: the scaled score at and above which the row keeps its tokens (``-inf``:
all; NaN: the row held a NaN). The core rebuilds the truncated scores from the cut where it
needs them (the shared generator's draw, log-probs), so neither draw sorts.

The kept set is ``generate``'s up to ties: where tied values straddle top-p's cut, generate's
sort keeps some of them and the kernel all. Near-boundary rounding may differ too (the masses
are summed in another order; min-p compares ``exp(s - max)`` with ``min_p``).

The launcher is a torch custom op (``graphcap_cuda::truncated_draw``) so that ``torch.compile``
and operator-level graph recorders see one opaque operation. With ``TRITON_INTERPRET=1`` set
before import it runs on CPU tensors (tests), with a portable ``log1p`` in place of libdevice's.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from graphcap.rollout.sampling import GOLDEN32
from graphcap_cuda.kernels import launch

launch.use_inductors_ptxas()

#: Columns a program reads at once.
BLOCK = 512
#: Thresholds one search pass tests (a power of two).
PIVOTS = 16
#: Search passes whose thresholds are spaced by value; the later ones by integer key.
VALUE_PASSES = 4
NUM_WARPS = 8
#: Under Triton's interpreter libdevice is missing: log1p and log come from ``tl.log``.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

_GOLDEN = tl.constexpr(GOLDEN32)
_INT_MAX = tl.constexpr(2**31 - 1)
_INT_MIN = tl.constexpr(-(2**31))


@triton.jit
def _hash32(x):
    """graphcap.rollout.sampling.hash32 (lowbias32) on uint32, whose products wrap."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _key(s):
    """An int32 ordered as the float32 values ``s`` are (-0 taken as +0; no NaN)."""
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(s == 0.0, 0, bits)
    return tl.where(bits < 0, bits ^ _INT_MAX, bits)


@triton.jit
def _value(key):
    """The float32 of ``key`` (inverse of :func:`_key`)."""
    bits = tl.where(key < 0, key ^ _INT_MAX, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scaled(base, cols, inside, temperature):
    """Columns ``cols`` of the row, NaN as ``-inf``, divided by the temperature (rounded as
    torch divides)."""
    x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    return x, tl.math.div_rn(x, temperature)


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _log1p(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log1p(x)
    else:
        w = 1.0 + x
        return tl.where(w == 1.0, x, tl.log(w) * (x / (w - 1.0)))


@triton.jit
def _gumbel(step_key, cols, PRECISE: tl.constexpr):
    """graphcap.rollout.sampling.gumbel at tokens ``cols`` of the stream ``step_key``."""
    bits = _hash32(step_key ^ _hash32(cols.to(tl.uint32) + _GOLDEN))
    u = tl.minimum((bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994)
    return -_log(-_log1p(-u, PRECISE), PRECISE)


@triton.jit
def _search(
    base,
    vocab,
    temperature,
    top,
    lo,
    hi,
    n_lo,
    k,
    floor,
    floor_key,
    BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr,
    VALUE_PASSES: tl.constexpr,
    MASS: tl.constexpr,
):
    """The largest key ``t`` in ``[lo, hi]`` (``t = lo`` holds) where ``count(key >= t) >= k``,
    or with ``MASS`` where ``mass(floor_key <= key < t) <= floor * mass(key >= floor_key)``
    (masses ``exp(s - top)``); any key with the same row values at and above it will do.
    ``n_lo``: ``count(key >= lo)``. Returns the key and its count."""
    j = tl.arange(0, PIVOTS) + 1
    n_hi = 0
    passes = 0
    while (lo < hi) & (n_lo - n_hi > 1):
        if passes < VALUE_PASSES:
            low = _value(lo)
            half = _value(hi) * 0.5 - low * 0.5
            pivots = _key(low + half * (j.to(tl.float32) * (2.0 / PIVOTS)))
        else:
            span = hi.to(tl.int64) - lo.to(tl.int64)
            pivots = (lo + (span * j + PIVOTS - 1) // PIVOTS).to(tl.int32)
        pivots = tl.where(j == PIVOTS, hi, tl.minimum(tl.maximum(pivots, lo + 1), hi))
        counts = tl.zeros([PIVOTS], tl.int32)
        below = tl.zeros([PIVOTS], tl.float32)
        total = 0.0
        inner_min = 2147483647
        inner_max = -2147483648
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < vocab
            _, s = _scaled(base, cols, inside, temperature)
            keys = _key(s)
            above = inside[:, None] & (keys[:, None] >= pivots[None, :])
            counts += tl.sum(above.to(tl.int32), axis=0)
            between = inside & (keys >= lo) & (keys <= hi)
            inner_min = tl.minimum(inner_min, tl.min(tl.where(between, keys, _INT_MAX)))
            inner_max = tl.maximum(inner_max, tl.max(tl.where(between, keys, _INT_MIN)))
            if MASS:
                e = tl.exp(s - top)
                kept = inside & (keys >= floor_key)
                total += tl.sum(tl.where(kept, e, 0.0))
                under = kept[:, None] & (keys[:, None] < pivots[None, :])
                below += tl.sum(tl.where(under, e[:, None], 0.0), axis=0)
        holds = below <= floor * total if MASS else counts >= k
        # the answer is a value of the row inside the interval this pass searched
        lo = tl.maximum(tl.max(tl.where(holds, pivots, lo)), inner_min)
        hi = tl.minimum(tl.min(tl.where(holds, hi, pivots - 1)), inner_max)
        n_lo = tl.min(tl.where(holds, counts, n_lo))
        n_hi = tl.max(tl.where(holds, n_hi, counts))
        passes += 1
    return lo, n_lo


@triton.jit
def _truncated_draw(
    scores_ptr,
    stride,
    temperature_ptr,
    top_k_ptr,
    floor_ptr,
    min_p_ptr,
    sample_ptr,
    seeded_ptr,
    key_ptr,
    finished_ptr,
    generated_ptr,
    generated_stride,
    tokens_ptr,
    cut_ptr,
    vocab,
    BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr,
    VALUE_PASSES: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched dependent (kernels.launch): the scores are the last kernel's
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    base = scores_ptr + row.to(tl.int64) * stride
    live = tl.load(finished_ptr + row).to(tl.int32) == 0
    sample = tl.load(sample_ptr + row).to(tl.int32) != 0
    seeded = sample & (tl.load(seeded_ptr + row).to(tl.int32) != 0)
    temperature = tl.load(temperature_ptr + row)
    k = tl.load(top_k_ptr + row)
    floor = tl.load(floor_ptr + row)
    min_p = tl.load(min_p_ptr + row)

    # 1. extremes (finished rows read nothing)
    nan_at = vocab
    first_max = 0
    best = float("-inf")
    top = float("-inf")
    low = float("inf")
    finite = 0
    for start in range(0, tl.where(live, vocab, 0), BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        raw = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        nan_at = tl.minimum(nan_at, tl.min(tl.where(inside & (raw != raw), cols, vocab)))
        x, s = _scaled(base, cols, inside, temperature)
        m = tl.max(x)
        at = tl.min(tl.where(inside & (x == m), cols, vocab))
        first_max = tl.where(m > best, at, first_max)
        best = tl.maximum(best, m)
        top = tl.maximum(top, tl.max(s))
        real = inside & (s > float("-inf"))
        low = tl.minimum(low, tl.min(tl.where(real, s, float("inf"))))
        finite += tl.sum(real.to(tl.int32))
    has_nan = nan_at < vocab
    flat = has_nan | ((top == float("-inf")) & (best == float("-inf")))
    lost = (~flat) & ((top == float("inf")) | (top == float("-inf")))
    normal = live & sample & (~flat) & (~lost)

    # 2. top-k, then top-p over what top-k kept
    use_k = normal & (k > 0) & (k < finite)
    use_p = normal & (floor > 0.0)
    cut = _key(low)
    n_cut = finite
    if use_k:
        cut, n_cut = _search(
            base, vocab, temperature, top, cut, _key(top), n_cut, k, floor, cut,
            BLOCK, PIVOTS, VALUE_PASSES, False,
        )  # fmt: skip
    if use_p:
        cut, n_cut = _search(
            base, vocab, temperature, top, cut, _key(top), n_cut, k, floor, cut,
            BLOCK, PIVOTS, VALUE_PASSES, True,
        )  # fmt: skip
    truncates = use_k | use_p
    cut = tl.where(truncates, cut, _INT_MIN)
    use_min_p = normal & (min_p > 0.0)

    # 3. the keyed draw over the kept tokens, and the smallest kept score
    counter = _hash32(tl.load(generated_ptr + row * generated_stride).to(tl.uint32) + _GOLDEN)
    step_key = _hash32(tl.load(key_ptr + row).to(tl.uint32) ^ counter)
    drawn = 0
    winner = float("-inf")
    smallest = float("inf")
    for start in range(0, tl.where(live & (seeded | use_min_p), vocab, 0), BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        x, s = _scaled(base, cols, inside, temperature)
        kept = inside & (_key(s) >= cut) & (tl.exp(s - top) >= min_p)
        smallest = tl.minimum(smallest, tl.min(tl.where(kept, s, float("inf"))))
        even = tl.where(inside & (flat | (x == best)), 0.0, float("-inf"))
        noisy = tl.where(normal, tl.where(kept, s, float("-inf")), even)
        noisy += _gumbel(step_key, cols, PRECISE)
        m = tl.max(noisy)
        at = tl.min(tl.where(inside & (noisy == m), cols, vocab))
        drawn = tl.where(m > winner, at, drawn)
        winner = tl.maximum(winner, m)

    if PDL:  # the next kernel may start
        tl.extra.cuda.gdc_launch_dependents()
    greedy = tl.where(has_nan, nan_at, first_max)
    token = tl.where(seeded, drawn, greedy)
    tl.store(tokens_ptr + row, tl.where(live, token, 0).to(tl.int64))
    bound = tl.where(use_min_p, smallest, tl.where(truncates, _value(cut), float("-inf")))
    bound = tl.where(live & has_nan, float("nan"), bound)
    tl.store(cut_ptr + row, tl.where(live & sample, bound, float("-inf")))


@torch.library.custom_op("graphcap_cuda::truncated_draw", mutates_args=())
def truncated_draw(
    scores: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p_floor: torch.Tensor,
    min_p: torch.Tensor,
    sample: torch.Tensor,
    seeded: torch.Tensor,
    key: torch.Tensor,
    finished: torch.Tensor,
    generated: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token and cut (module docstring). ``scores``: float32 (B, V) with unit stride
    in the last dimension; the settings are :class:`graphcap.rollout.sampling.RowSettings`'
    (B,) columns; ``generated``: the step counter, one for all rows or one per row."""
    rows, vocab = scores.shape
    tokens = torch.empty(rows, dtype=torch.long, device=scores.device)
    cut = torch.empty(rows, dtype=torch.float32, device=scores.device)
    counter = generated.reshape(-1)
    pdl = launch.dependent(scores.device)
    if rows:
        _truncated_draw[(rows,)](
            scores,
            scores.stride(0),
            temperature,
            top_k,
            top_p_floor,
            min_p,
            sample,
            seeded,
            key,
            finished,
            counter,
            0 if counter.numel() == 1 else 1,
            tokens,
            cut,
            vocab,
            BLOCK=BLOCK,
            PIVOTS=PIVOTS,
            VALUE_PASSES=VALUE_PASSES,
            PRECISE=not INTERPRETED,
            PDL=pdl,
            num_warps=NUM_WARPS,
            launch_pdl=pdl,
        )
    return tokens, cut


@truncated_draw.register_fake
def _(scores, temperature, top_k, top_p_floor, min_p, sample, seeded, key, finished, generated):
    rows = scores.shape[0]
    return scores.new_empty(rows, dtype=torch.long), scores.new_empty(rows)
