"""Truncation (top-k, top-p, min-p) and the keyed draw of a decode step in Triton, without
sorting the vocabulary.

Each row is split into chunks of ``BLOCK * CHUNK_BLOCKS`` columns, and every pass over the
scores runs one program per row and chunk; the next launch's programs combine their row's
partial results (a few dozen numbers), so no launch sits between passes to combine them. The
launches are the same for every step (a captured graph replays them whatever its rows ask);
a row with nothing to do in one reads its settings and stops:

1. ``_extremes``: each chunk's first maximum (greedy rows' token; a NaN's column wins, as in
   ``torch.argmax``), largest and smallest finite temperature-scaled score, first NaN, finite
   count; and for a keyed row with temperature alone (no truncation, no min-p) its draw over
   the chunk, from the same read.
2. :data:`SEARCH_LAUNCHES` ``_search_pass`` launches: a threshold search per active
   truncation. The kept set of top-k, of top-p (after top-k) and of min-p is an upper set of
   the row's values, so each is one cut: the largest threshold ``t`` with
   ``count(s >= t) >= k`` (top-k), then with
   ``mass(cut_k <= s < t) <= (1 - top_p) * mass(s >= cut_k)`` (top-p, the ascending
   cumulative sum that ``generate`` compares with ``1 - top_p``). A pass tests :data:`PIVOTS`
   thresholds at once (each chunk counts and sums at them) and keeps the interval between the
   last that holds and the first that does not: spaced by value for the first
   :data:`VALUE_PASSES` passes (few passes on logits), then by the float's integer key (at
   most eight more for any row), snapped to the values inside. It stops when one value is
   left in the interval. Once the largest threshold that holds has at most :data:`GATHER`
   tokens at or above it, the row gathers them instead (scaled score and token id, in column
   order), and the last kernel ends its searches among them.
3. ``_draw_pass``, for rows with a key or min-p whose cut is known: Gumbel-max over the
   chunk's kept tokens with the noise of :func:`graphcap.rollout.sampling.gumbel` (the same
   counter-based hash stream, computed per token here instead of read from a (B, V) tensor),
   and the chunk's smallest kept score.
4. ``_finish``, a program per row: combines the chunks' draws (the first chunk holding the
   largest noisy score), or ends the search and draws among the gathered tokens, or, for a
   row the search launches left unfinished (values crowded within a few ulps), ends the
   search and draws over its whole row on this one program; writes the token and the cut.

Full reads of the scores per step: temperature alone one; min-p two; top-k (with top-p or
not) and a top-p whose cut lies among at most :data:`GATHER` tokens typically three; a wide
top-p one per search pass plus two. Its speed on a GPU is not measured yet
(docs/decisions.md, 94).

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
and operator-level graph recorders see one opaque operation; the partial results are
allocated per call (inside a capture, from the graph's pool). With ``TRITON_INTERPRET=1`` set
before import it runs on CPU tensors (tests), with a portable ``log1p`` in place of
libdevice's.
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
#: Blocks per chunk: a row is split into chunks of ``BLOCK * CHUNK_BLOCKS`` columns, one program
#: each (Llama 3's 128,256 tokens: 16 chunks, so 4,096 programs a pass at batch 256).
CHUNK_BLOCKS = 16
#: Columns a search pass reads at once (a power of two): each lane keeps a count and a mass
#: for every threshold, ``SEARCH_BLOCK * PIVOTS`` of each a program.
SEARCH_BLOCK = 256
#: Thresholds one search pass tests (a power of two).
PIVOTS = 16
#: Search passes whose thresholds are spaced by value; the later ones by integer key.
VALUE_PASSES = 4
#: Search launches a step makes whatever its rows ask (a captured graph's launches are fixed);
#: a row still searching after them finishes in the last kernel, on one program.
SEARCH_LAUNCHES = 6
#: Most tokens a row gathers (a power of two): once a search knows a threshold at or below its
#: cut with at most this many tokens at or above it, the row gathers them and the last kernel
#: finishes the search and draws among them alone.
GATHER = 2048
NUM_WARPS = 8
#: Under Triton's interpreter libdevice is missing: log1p and log come from ``tl.log``.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

_GOLDEN = tl.constexpr(GOLDEN32)
_INT_MAX = tl.constexpr(2**31 - 1)
_INT_MIN = tl.constexpr(-(2**31))
#: A row's search phase (its state's first field).
_DONE = tl.constexpr(0)  # cut known (``lo``; the smallest int32 where the row does not truncate)
_TOP_K = tl.constexpr(1)  # counting: the k-th largest value
_TOP_P = tl.constexpr(2)  # summing masses above top-k's cut (``floor_key``)
_GATHERED_K = tl.constexpr(3)  # tokens at or above a threshold under top-k's cut gathered
_GATHERED_P = tl.constexpr(4)  # likewise under top-p's, with the mass below it known
#: int32 fields of a row's search state: phase, lo, hi, n_lo, n_hi, passes, floor_key, gathered
#: count, mass below the gathered tokens and total mass (float32 bits).
STATE = 10


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
def _first_best(values, cols):
    """The largest of ``values`` (a lane each) and the smallest column holding it."""
    best = tl.max(values, axis=0)
    return best, tl.min(tl.where(values == best, cols, _INT_MAX), axis=0)


@triton.jit
def _row(
    row,
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
):
    """A row's settings, and its step key (the stream its keyed draw reads)."""
    live = tl.load(finished_ptr + row).to(tl.int32) == 0
    sample = tl.load(sample_ptr + row).to(tl.int32) != 0
    seeded = sample & (tl.load(seeded_ptr + row).to(tl.int32) != 0)
    temperature = tl.load(temperature_ptr + row)
    k = tl.load(top_k_ptr + row)
    floor = tl.load(floor_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    counter = _hash32(tl.load(generated_ptr + row * generated_stride).to(tl.uint32) + _GOLDEN)
    step_key = _hash32(tl.load(key_ptr + row).to(tl.uint32) ^ counter)
    return live, sample, seeded, temperature, k, floor, min_p, step_key


@triton.jit
def _extremes_of(ext_f, ext_i, row, chunks, CHUNKS_P2: tl.constexpr):
    """The row's extremes from its chunks' (:func:`_extremes`): the first maximum's column and
    value, the largest and smallest finite scaled score, the first NaN's column (``INT_MAX``:
    none), the count of finite scaled scores."""
    c = tl.arange(0, CHUNKS_P2)
    ok = c < chunks
    at = (row * chunks + c) * 3
    best_c = tl.load(ext_f + at, mask=ok, other=float("-inf"))
    top = tl.max(tl.load(ext_f + at + 1, mask=ok, other=float("-inf")))
    low = tl.min(tl.load(ext_f + at + 2, mask=ok, other=float("inf")))
    first_c = tl.load(ext_i + at, mask=ok, other=_INT_MAX)
    nan_at = tl.min(tl.load(ext_i + at + 1, mask=ok, other=_INT_MAX))
    finite = tl.sum(tl.load(ext_i + at + 2, mask=ok, other=0))
    best = tl.max(best_c)
    # the first chunk holding the maximum holds its first column (a row of -inf: column 0)
    first_max = tl.min(tl.where(ok & (best_c == best), first_c, _INT_MAX))
    return first_max, best, top, low, nan_at, finite


@triton.jit
def _classes(live, sample, k, floor, min_p, best, top, nan_at, finite, vocab):
    """As :func:`graphcap.rollout.sampling.sanitise` sorts rows: ``flat`` (a NaN or nothing
    finite: uniform), ``lost`` (scaled scores overflowed: among the maximum's tokens),
    ``normal``; and which truncations a normal sampled row applies."""
    has_nan = nan_at < vocab
    flat = has_nan | ((top == float("-inf")) & (best == float("-inf")))
    lost = (~flat) & ((top == float("inf")) | (top == float("-inf")))
    normal = live & sample & (~flat) & (~lost)
    use_k = normal & (k > 0) & (k < finite)
    use_p = normal & (floor > 0.0)
    use_min_p = normal & (min_p > 0.0)
    return has_nan, flat, normal, use_k, use_p, use_min_p


@triton.jit
def _plain(live, seeded, k, floor, min_p):
    """A keyed row with temperature alone (no truncation, no min-p), known before its extremes:
    :func:`_extremes` draws it."""
    return live & seeded & (k <= 0) & (floor <= 0.0) & (min_p <= 0.0)


@triton.jit
def _pivots(lo, hi, passes, PIVOTS: tl.constexpr, VALUE_PASSES: tl.constexpr):
    """The thresholds a search pass tests in ``(lo, hi]``, ascending, the last ``hi``: spaced
    by value for the first passes, then by integer key."""
    j = tl.arange(0, PIVOTS) + 1
    if passes < VALUE_PASSES:
        low = _value(lo)
        half = _value(hi) * 0.5 - low * 0.5
        pivots = _key(low + half * (j.to(tl.float32) * (2.0 / PIVOTS)))
    else:
        span = hi.to(tl.int64) - lo.to(tl.int64)
        pivots = (lo + (span * j + PIVOTS - 1) // PIVOTS).to(tl.int32)
    return tl.where(j == PIVOTS, hi, tl.minimum(tl.maximum(pivots, lo + 1), hi))


@triton.jit
def _tally(
    base,
    start,
    end,
    temperature,
    top,
    pivots,
    lo,
    hi,
    floor_key,
    BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr,
    MASS: tl.constexpr,
):
    """Over columns ``[start, end)``: the count of keys at or above each pivot, with ``MASS``
    the mass ``exp(s - top)`` of keys from ``floor_key`` to below each pivot and from
    ``floor_key`` up, and the smallest and largest key inside ``[lo, hi]``. Each lane keeps
    its own sums over the blocks, reduced once at the end: no block-wide reduction (a barrier)
    in the loop."""
    counts = tl.zeros([BLOCK, PIVOTS], tl.int32)
    below = tl.zeros([BLOCK, PIVOTS], tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    inner_min = tl.full([BLOCK], _INT_MAX, tl.int32)
    inner_max = tl.full([BLOCK], _INT_MIN, tl.int32)
    for first in range(start, end, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        inside = cols < end
        _unscaled, s = _scaled(base, cols, inside, temperature)
        keys = _key(s)
        above = inside[:, None] & (keys[:, None] >= pivots[None, :])
        counts += above.to(tl.int32)
        between = inside & (keys >= lo) & (keys <= hi)
        inner_min = tl.minimum(inner_min, tl.where(between, keys, _INT_MAX))
        inner_max = tl.maximum(inner_max, tl.where(between, keys, _INT_MIN))
        if MASS:
            e = tl.exp(s - top)
            kept = inside & (keys >= floor_key)
            total += tl.where(kept, e, 0.0)
            under = kept[:, None] & (keys[:, None] < pivots[None, :])
            below += tl.where(under, e[:, None], 0.0)
    return (
        tl.sum(counts, axis=0),
        tl.sum(below, axis=0),
        tl.sum(total, axis=0),
        tl.min(inner_min, axis=0),
        tl.max(inner_max, axis=0),
    )


@triton.jit
def _narrow(lo, hi, n_lo, n_hi, pivots, holds, counts, inner_min, inner_max):
    """The interval left after a pass: between the last pivot that holds and the first that
    does not, snapped to the row's values inside it (the answer is one of them)."""
    new_lo = tl.maximum(tl.max(tl.where(holds, pivots, lo)), inner_min)
    new_hi = tl.minimum(tl.min(tl.where(holds, hi, pivots - 1)), inner_max)
    new_n_lo = tl.min(tl.where(holds, counts, n_lo))
    new_n_hi = tl.max(tl.where(holds, n_hi, counts))
    return new_lo, new_hi, new_n_lo, new_n_hi


@triton.jit
def _search(
    base,
    vocab,
    temperature,
    top,
    lo,
    hi,
    n_lo,
    n_hi,
    passes,
    k,
    floor,
    floor_key,
    below_before,
    total_given,
    BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr,
    VALUE_PASSES: tl.constexpr,
    MASS: tl.constexpr,
):
    """The largest key ``t`` in ``[lo, hi]`` (``t = lo`` holds) where ``count(key >= t) >= k``,
    or with ``MASS`` where ``mass(floor_key <= key < t) <= floor * mass(key >= floor_key)``
    (masses ``exp(s - top)``), by passes of one program over ``vocab`` columns at ``base``: a
    whole row whose search the split passes left unfinished, or a row's gathered tokens (then
    ``below_before``: the mass from ``floor_key`` to below them; ``total_given``, where not
    negative: the row's total). Any key with the same row values at and above it will do.
    ``n_lo`` / ``n_hi``: ``count(key >= lo)`` / ``count(key > hi)``. Returns the key and its
    count."""
    while (lo < hi) & (n_lo - n_hi > 1):
        pivots = _pivots(lo, hi, passes, PIVOTS, VALUE_PASSES)
        counts, below, total, inner_min, inner_max = _tally(
            base, 0, vocab, temperature, top, pivots, lo, hi, floor_key, BLOCK, PIVOTS, MASS
        )
        total = tl.where(total_given < 0.0, total, total_given)
        holds = below + below_before <= floor * total if MASS else counts >= k
        lo, hi, n_lo, n_hi = _narrow(
            lo, hi, n_lo, n_hi, pivots, holds, counts, inner_min, inner_max
        )
        passes += 1
    return lo, n_lo


@triton.jit
def _settle(phase, lo, hi, n_lo, n_hi, passes, floor_key, use_p, top):
    """A search whose interval holds one value (or one count) is over: top-k's hands its cut
    to top-p's search (``floor_key``), the last gives the row its cut (``lo``)."""
    searching = (phase == _TOP_K) | (phase == _TOP_P)
    over = searching & ((lo >= hi) | (n_lo - n_hi <= 1))
    to_p = over & (phase == _TOP_K) & use_p
    floor_key = tl.where(to_p, lo, floor_key)
    hi = tl.where(to_p, _key(top), hi)
    n_hi = tl.where(to_p, 0, n_hi)
    passes = tl.where(to_p, 0, passes)
    done = (over & ~to_p) | (to_p & ((lo >= hi) | (n_lo - n_hi <= 1)))
    phase = tl.where(to_p, _TOP_P, phase)
    phase = tl.where(done, _DONE, phase)
    return phase, lo, hi, n_lo, n_hi, passes, floor_key


@triton.jit
def _start(use_k, use_p, low, top, finite):
    """A row's search state before any pass (:data:`STATE`)."""
    phase = tl.where(use_k, _TOP_K, tl.where(use_p, _TOP_P, _DONE))
    lo = tl.where(use_k | use_p, _key(low), _INT_MIN)
    zero = tl.full([], 0, tl.int32)
    phase, lo, hi, n_lo, n_hi, passes, floor_key = _settle(
        phase, lo, _key(top), finite, zero, zero, lo, use_p, top
    )
    none = tl.full([], 0.0, tl.float32)
    return phase, lo, hi, n_lo, n_hi, passes, floor_key, zero, none, none


@triton.jit
def _advance(
    state_ptr,
    counts_ptr,
    masses_ptr,
    row,
    part,
    chunks,
    k,
    floor,
    top,
    use_p,
    GATHER_OK: tl.constexpr,
    PIVOTS: tl.constexpr,
    VALUE_PASSES: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    GATHER: tl.constexpr,
):
    """The row's search state after the last split pass, from the state that pass searched
    with and the chunks' tallies (the combine step). With ``GATHER_OK`` a row whose largest
    holding pivot has at most :data:`GATHER` tokens at or above it gathers them (``fresh``;
    ``offset``: where chunk ``part``'s go). Returns the state and (offset, fresh)."""
    st = state_ptr + row * 10
    phase = tl.load(st)
    lo = tl.load(st + 1)
    hi = tl.load(st + 2)
    n_lo = tl.load(st + 3)
    n_hi = tl.load(st + 4)
    passes = tl.load(st + 5)
    floor_key = tl.load(st + 6)
    gathered = tl.load(st + 7)
    mass_below = tl.load(st + 8).to(tl.float32, bitcast=True)
    mass_total = tl.load(st + 9).to(tl.float32, bitcast=True)
    searching = (phase == _TOP_K) | (phase == _TOP_P)
    j = tl.arange(0, PIVOTS)
    c = tl.arange(0, CHUNKS_P2)
    ok = c < tl.where(searching, chunks, 0)  # (a scalar mask term fails interpreted)
    both = ok[:, None] & (j[None, :] < PIVOTS)
    at = row * chunks + c
    per_chunk = tl.load(counts_ptr + at[:, None] * (PIVOTS + 2) + j[None, :], mask=both, other=0)
    counts = tl.sum(per_chunk, axis=0)
    inner_min = tl.min(tl.load(counts_ptr + at * (PIVOTS + 2) + PIVOTS, mask=ok, other=_INT_MAX))
    inner_max = tl.max(
        tl.load(counts_ptr + at * (PIVOTS + 2) + PIVOTS + 1, mask=ok, other=_INT_MIN)
    )
    masses = tl.load(masses_ptr + at[:, None] * (PIVOTS + 1) + j[None, :], mask=both, other=0.0)
    below = tl.sum(masses, axis=0)
    total = tl.sum(tl.load(masses_ptr + at * (PIVOTS + 1) + PIVOTS, mask=ok, other=0.0))
    pivots = _pivots(lo, hi, passes, PIVOTS, VALUE_PASSES)
    holds = tl.where(phase == _TOP_P, below <= floor * total, counts >= k)
    # the largest pivot that holds: the tokens at or above it hold the row's cut
    last = tl.max(tl.where(holds, j, -1))
    picked = j == last
    n_last = tl.sum(tl.where(picked, counts, 0))
    fresh = GATHER_OK & searching & (last >= 0) & (n_last <= GATHER)
    offset = tl.sum(tl.sum(tl.where((c[:, None] < part) & picked[None, :], per_chunk, 0), axis=1))
    new_lo, new_hi, new_n_lo, new_n_hi = _narrow(
        lo, hi, n_lo, n_hi, pivots, holds, counts, inner_min, inner_max
    )
    phase2, lo2, hi2, n_lo2, n_hi2, passes2, floor_key2 = _settle(
        phase, new_lo, new_hi, new_n_lo, new_n_hi, passes + 1, floor_key, use_p, top
    )
    # a search in progress moves on (or ends), a gathering row records what it gathered
    phase = tl.where(fresh, phase + 2, tl.where(searching, phase2, phase))
    lo = tl.where(fresh, tl.sum(tl.where(picked, pivots, 0)), tl.where(searching, lo2, lo))
    hi = tl.where(searching, hi2, hi)
    n_lo = tl.where(searching, n_lo2, n_lo)
    n_hi = tl.where(searching, n_hi2, n_hi)
    passes = tl.where(searching, passes2, passes)
    floor_key = tl.where(searching & ~fresh, floor_key2, floor_key)
    gathered = tl.where(fresh, n_last, gathered)
    mass_below = tl.where(fresh, tl.sum(tl.where(picked, below, 0.0)), mass_below)
    mass_total = tl.where(fresh, total, mass_total)
    state = (phase, lo, hi, n_lo, n_hi, passes, floor_key, gathered, mass_below, mass_total)
    return state, offset, fresh


@triton.jit
def _store_state(state_ptr, row, state):
    phase, lo, hi, n_lo, n_hi, passes, floor_key, gathered, mass_below, mass_total = state
    st = state_ptr + row * 10
    tl.store(st, phase)
    tl.store(st + 1, lo)
    tl.store(st + 2, hi)
    tl.store(st + 3, n_lo)
    tl.store(st + 4, n_hi)
    tl.store(st + 5, passes)
    tl.store(st + 6, floor_key)
    tl.store(st + 7, gathered)
    tl.store(st + 8, mass_below.to(tl.int32, bitcast=True))
    tl.store(st + 9, mass_total.to(tl.int32, bitcast=True))


@triton.jit
def _draw(
    base,
    cols_ptr,
    start,
    end,
    temperature,
    step_key,
    cut,
    top,
    best,
    min_p,
    flat,
    normal,
    BLOCK: tl.constexpr,
    INDIRECT: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """The keyed Gumbel-max draw over columns ``[start, end)`` (``INDIRECT``: over gathered
    scores, whose token ids are at ``cols_ptr``): the largest noisy score, its first token,
    and the smallest kept score. Normal rows draw among the tokens at or above ``cut`` that
    min-p keeps, flat rows among all, others among the maximum's tokens. Each lane keeps its
    own winner, reduced once at the end."""
    drawn = tl.zeros([BLOCK], tl.int32) + start
    winner = tl.full([BLOCK], float("-inf"), tl.float32)
    smallest = tl.full([BLOCK], float("inf"), tl.float32)
    for first in range(start, end, BLOCK):
        at = first + tl.arange(0, BLOCK)
        inside = at < end
        x, s = _scaled(base, at, inside, temperature)
        cols = tl.load(cols_ptr + at, mask=inside, other=0) if INDIRECT else at
        kept = inside & (_key(s) >= cut) & (tl.exp(s - top) >= min_p)
        smallest = tl.minimum(smallest, tl.where(kept, s, float("inf")))
        even = tl.where(inside & (flat | (x == best)), 0.0, float("-inf"))
        noisy = tl.where(normal, tl.where(kept, s, float("-inf")), even)
        noisy += _gumbel(step_key, cols, PRECISE)
        drawn = tl.where(noisy > winner, cols, drawn)  # a lane's first: its columns ascend
        winner = tl.maximum(winner, noisy)
    winner, drawn = _first_best(winner, drawn)
    return winner, drawn, tl.min(smallest, axis=0)


@triton.jit
def _extremes(
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
    ext_f,
    ext_i,
    draw_f,
    draw_i,
    vocab,
    chunk,
    BLOCK: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Pass 1, a program per row and chunk: the chunk's first maximum (value, column), largest
    and smallest finite scaled score, first NaN's column, finite count; and for a keyed row
    that neither truncates nor applies min-p (temperature alone), its draw over the chunk in
    the same read (:func:`_draw_pass` then skips the row unless its scores turn out not
    normal). Finished rows read nothing."""
    if PDL:  # launched dependent (kernels.launch): the scores are the last kernel's
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    part = tl.program_id(1)
    chunks = tl.num_programs(1)
    base = scores_ptr + row.to(tl.int64) * stride
    live, _sample, seeded, temperature, k, floor, min_p, step_key = _row(
        row, temperature_ptr, top_k_ptr, floor_ptr, min_p_ptr, sample_ptr, seeded_ptr,
        key_ptr, finished_ptr, generated_ptr, generated_stride,
    )  # fmt: skip
    plain = _plain(live, seeded, k, floor, min_p)
    start = part * chunk
    end = tl.minimum(start + chunk, vocab)
    # a lane each, reduced once after the loop (no block-wide reduction in it)
    nan_at = tl.full([BLOCK], _INT_MAX, tl.int32)
    first_max = tl.zeros([BLOCK], tl.int32) + start
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    finite = tl.zeros([BLOCK], tl.int32)
    drawn = tl.zeros([BLOCK], tl.int32) + start
    winner = tl.full([BLOCK], float("-inf"), tl.float32)
    for first in range(start, tl.where(live, end, start), BLOCK):
        cols = first + tl.arange(0, BLOCK)
        inside = cols < end
        raw = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        nan_at = tl.minimum(nan_at, tl.where(inside & (raw != raw), cols, _INT_MAX))
        x = tl.where(raw != raw, float("-inf"), raw)
        s = tl.math.div_rn(x, temperature)
        first_max = tl.where(x > best, cols, first_max)  # a lane's first: its columns ascend
        best = tl.maximum(best, x)
        top = tl.maximum(top, s)
        real = inside & (s > float("-inf"))
        low = tl.minimum(low, tl.where(real, s, float("inf")))
        finite += real.to(tl.int32)
        if plain:  # _draw's for a normal row keeping every token
            noisy = tl.where(inside, s, float("-inf")) + _gumbel(step_key, cols, PRECISE)
            drawn = tl.where(noisy > winner, cols, drawn)
            winner = tl.maximum(winner, noisy)
    # the first column of the maximum (a row of -inf: the chunk's first)
    best, first_max = _first_best(best, first_max)
    winner, drawn = _first_best(winner, drawn)
    if PDL:  # the next kernel may start
        tl.extra.cuda.gdc_launch_dependents()
    at = (row * chunks + part) * 3
    tl.store(ext_f + at, best)
    tl.store(ext_f + at + 1, tl.max(top, axis=0))
    tl.store(ext_f + at + 2, tl.min(low, axis=0))
    tl.store(ext_i + at, first_max)
    tl.store(ext_i + at + 1, tl.min(nan_at, axis=0))
    tl.store(ext_i + at + 2, tl.sum(finite, axis=0))
    if plain:
        at = row * chunks + part
        tl.store(draw_f + at * 2, winner)
        tl.store(draw_f + at * 2 + 1, float("inf"))
        tl.store(draw_i + at, drawn)


@triton.jit
def _search_pass(
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
    ext_f,
    ext_i,
    state_in,
    counts_in,
    masses_in,
    state_out,
    counts_out,
    masses_out,
    gathered_scores,
    gathered_cols,
    vocab,
    chunk,
    FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr,
    VALUE_PASSES: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    GATHER: tl.constexpr,
    PDL: tl.constexpr,
):
    """One split search pass, a program per row and chunk: every program combines the last
    pass's tallies of its row (:func:`_advance`; the first pass starts from the extremes), the
    chunk-0 program stores the new state, and each tallies its chunk at the new pivots, or
    gathers its tokens at or above the row's gathering threshold. Rows with nothing to search
    read nothing."""
    if PDL:  # launched dependent: the extremes, states and tallies are earlier kernels'
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    part = tl.program_id(1)
    chunks = tl.num_programs(1)
    live, sample, _seeded, temperature, k, floor, min_p, _key_of_step = _row(
        row, temperature_ptr, top_k_ptr, floor_ptr, min_p_ptr, sample_ptr, seeded_ptr,
        key_ptr, finished_ptr, generated_ptr, generated_stride,
    )  # fmt: skip
    if live & sample & ((k > 0) | (floor > 0.0)):
        _first_max, best, top, low, nan_at, finite = _extremes_of(
            ext_f, ext_i, row, chunks, CHUNKS_P2
        )
        _has_nan, _flat, _normal, use_k, use_p, _use_min_p = _classes(
            live, sample, k, floor, min_p, best, top, nan_at, finite, vocab
        )
        if FIRST:
            state = _start(use_k, use_p, low, top, finite)
            offset = 0
            fresh = False
        else:
            state, offset, fresh = _advance(
                state_in, counts_in, masses_in, row, part, chunks, k, floor, top, use_p,
                True, PIVOTS, VALUE_PASSES, CHUNKS_P2, GATHER,
            )  # fmt: skip
        if part == 0:
            _store_state(state_out, row, state)
        phase, lo, hi, _n_lo, _n_hi, passes, floor_key, _count, _below, _total = state
        base = scores_ptr + row.to(tl.int64) * stride
        start = part * chunk
        end = tl.minimum(start + chunk, vocab)
        at = row * chunks + part
        j = tl.arange(0, PIVOTS)
        if phase == _TOP_K:
            pivots = _pivots(lo, hi, passes, PIVOTS, VALUE_PASSES)
            counts, below, total, inner_min, inner_max = _tally(
                base, start, end, temperature, top, pivots, lo, hi, floor_key,
                SEARCH_BLOCK, PIVOTS, False,
            )  # fmt: skip
            tl.store(counts_out + at * (PIVOTS + 2) + j, counts)
            tl.store(counts_out + at * (PIVOTS + 2) + PIVOTS, inner_min)
            tl.store(counts_out + at * (PIVOTS + 2) + PIVOTS + 1, inner_max)
        if phase == _TOP_P:
            pivots = _pivots(lo, hi, passes, PIVOTS, VALUE_PASSES)
            counts, below, total, inner_min, inner_max = _tally(
                base, start, end, temperature, top, pivots, lo, hi, floor_key,
                SEARCH_BLOCK, PIVOTS, True,
            )  # fmt: skip
            tl.store(counts_out + at * (PIVOTS + 2) + j, counts)
            tl.store(counts_out + at * (PIVOTS + 2) + PIVOTS, inner_min)
            tl.store(counts_out + at * (PIVOTS + 2) + PIVOTS + 1, inner_max)
            tl.store(masses_out + at * (PIVOTS + 1) + j, below)
            tl.store(masses_out + at * (PIVOTS + 1) + PIVOTS, total)
        if fresh:  # this chunk's tokens at or above the threshold, in column order
            n = offset
            for first in range(start, end, BLOCK):
                cols = first + tl.arange(0, BLOCK)
                inside = cols < end
                _unscaled, s = _scaled(base, cols, inside, temperature)
                keys = _key(s)
                take = inside & (keys >= lo)
                slot = row * GATHER + n + tl.cumsum(take.to(tl.int32), 0) - 1
                tl.store(gathered_scores + slot, s, mask=take)
                tl.store(gathered_cols + slot, cols, mask=take)
                n += tl.sum(take.to(tl.int32))
    if PDL:  # the next kernel may start
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _draw_pass(
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
    ext_f,
    ext_i,
    state_in,
    counts_in,
    masses_in,
    draw_f,
    draw_i,
    vocab,
    chunk,
    BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr,
    VALUE_PASSES: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    GATHER: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """The split draw, a program per row and chunk, for rows whose cut is known (or that do not
    truncate) and that draw from their stream or apply min-p: the chunk's winner, its column
    and smallest kept score. Other rows read nothing."""
    if PDL:  # launched dependent: the extremes, states and tallies are earlier kernels'
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    part = tl.program_id(1)
    chunks = tl.num_programs(1)
    live, sample, seeded, temperature, k, floor, min_p, step_key = _row(
        row, temperature_ptr, top_k_ptr, floor_ptr, min_p_ptr, sample_ptr, seeded_ptr,
        key_ptr, finished_ptr, generated_ptr, generated_stride,
    )  # fmt: skip
    _first_max, best, top, _low, nan_at, finite = _extremes_of(ext_f, ext_i, row, chunks, CHUNKS_P2)
    _has_nan, flat, normal, use_k, use_p, use_min_p = _classes(
        live, sample, k, floor, min_p, best, top, nan_at, finite, vocab
    )
    phase = tl.full([], _DONE, tl.int32)
    cut = tl.full([], _INT_MIN, tl.int32)
    if use_k | use_p:
        state, _offset, _fresh = _advance(
            state_in, counts_in, masses_in, row, part, chunks, k, floor, top, use_p,
            False, PIVOTS, VALUE_PASSES, CHUNKS_P2, GATHER,
        )  # fmt: skip
        phase = state[0]
        cut = state[1]
    drawn_already = _plain(live, seeded, k, floor, min_p) & normal
    if live & (seeded | use_min_p) & (phase == _DONE) & ~drawn_already:
        start = part * chunk
        end = tl.minimum(start + chunk, vocab)
        winner, drawn, smallest = _draw(
            scores_ptr + row.to(tl.int64) * stride, scores_ptr, start, end, temperature,
            step_key, cut, top, best, min_p, flat, normal, BLOCK, False, PRECISE,
        )  # fmt: skip
        at = row * chunks + part
        tl.store(draw_f + at * 2, winner)
        tl.store(draw_f + at * 2 + 1, smallest)
        tl.store(draw_i + at, drawn)
    if PDL:  # the next kernel may start
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _finish(
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
    ext_f,
    ext_i,
    state_in,
    counts_in,
    masses_in,
    gathered_scores,
    gathered_cols,
    draw_f,
    draw_i,
    tokens_ptr,
    cut_ptr,
    vocab,
    chunks,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr,
    VALUE_PASSES: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    GATHER: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    """A program per row: its token and cut. A row whose cut is known combines its chunks'
    draws; a gathering row ends its search and draws among its gathered tokens; a row still
    searching (few rows: values crowded within a few ulps) ends it and draws over its whole
    row here, as one program."""
    if PDL:  # launched dependent: every input is an earlier kernel's
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    live, sample, seeded, temperature, k, floor, min_p, step_key = _row(
        row, temperature_ptr, top_k_ptr, floor_ptr, min_p_ptr, sample_ptr, seeded_ptr,
        key_ptr, finished_ptr, generated_ptr, generated_stride,
    )  # fmt: skip
    first_max, best, top, low, nan_at, finite = _extremes_of(ext_f, ext_i, row, chunks, CHUNKS_P2)
    has_nan, flat, normal, use_k, use_p, use_min_p = _classes(
        live, sample, k, floor, min_p, best, top, nan_at, finite, vocab
    )
    phase, lo, hi, n_lo, n_hi, passes, floor_key, gathered, mass_below, mass_total = _start(
        use_k, use_p, low, top, finite
    )
    if use_k | use_p:
        state, _offset, _fresh = _advance(
            state_in, counts_in, masses_in, row, 0, chunks, k, floor, top, use_p,
            False, PIVOTS, VALUE_PASSES, CHUNKS_P2, GATHER,
        )  # fmt: skip
        phase, lo, hi, n_lo, n_hi, passes, floor_key, gathered, mass_below, mass_total = state
    draws = live & (seeded | use_min_p)
    cut = lo
    zero = tl.full([], 0, tl.int32)
    drawn = zero
    smallest = tl.full([], float("inf"), tl.float32)
    if phase == _DONE:
        if draws:  # the chunks' draws: the first chunk holding the largest noisy score
            c = tl.arange(0, CHUNKS_P2)
            ok = c < chunks
            at = row * chunks + c
            winners = tl.load(draw_f + at * 2, mask=ok, other=float("-inf"))
            winner = tl.max(winners)
            drawn = tl.min(
                tl.where(ok & (winners == winner), tl.load(draw_i + at, mask=ok), _INT_MAX)
            )
            smallest = tl.min(tl.load(draw_f + at * 2 + 1, mask=ok, other=float("inf")))
    elif phase >= _GATHERED_K:  # the search ends among the gathered tokens, the draw too
        gathered_row = gathered_scores + row * GATHER
        if phase == _GATHERED_K:  # top-p's masses are all gathered
            lo, n_lo = _search(
                gathered_row, gathered, 1.0, top, lo, _key(top), gathered, zero, zero, k,
                floor, lo, 0.0, -1.0, SEARCH_BLOCK, PIVOTS, VALUE_PASSES, False,
            )  # fmt: skip
            floor_key = lo
            mass_below = tl.full([], 0.0, tl.float32)
            mass_total = tl.full([], -1.0, tl.float32)
        else:
            n_lo = gathered
        cut = lo
        if use_p:
            cut, n_lo = _search(
                gathered_row, gathered, 1.0, top, lo, _key(top), n_lo, zero, zero, k, floor,
                floor_key, mass_below, mass_total, SEARCH_BLOCK, PIVOTS, VALUE_PASSES, True,
            )  # fmt: skip
        if draws:
            _winner, drawn, smallest = _draw(
                gathered_row, gathered_cols + row * GATHER, 0, gathered, 1.0, step_key, cut,
                top, best, min_p, flat, normal, BLOCK, True, PRECISE,
            )  # fmt: skip
    else:  # still searching after the split passes: whole-row passes, then the draw
        base = scores_ptr + row.to(tl.int64) * stride
        if phase == _TOP_K:
            cut, n_lo = _search(
                base, vocab, temperature, top, lo, hi, n_lo, n_hi, passes, k, floor, floor_key,
                0.0, -1.0, SEARCH_BLOCK, PIVOTS, VALUE_PASSES, False,
            )  # fmt: skip
            if use_p:
                cut, n_lo = _search(
                    base, vocab, temperature, top, cut, _key(top), n_lo, zero, zero, k, floor, cut,
                    0.0, -1.0, SEARCH_BLOCK, PIVOTS, VALUE_PASSES, True,
                )  # fmt: skip
        else:
            cut, n_lo = _search(
                base, vocab, temperature, top, lo, hi, n_lo, n_hi, passes, k, floor, floor_key,
                0.0, -1.0, SEARCH_BLOCK, PIVOTS, VALUE_PASSES, True,
            )  # fmt: skip
        if draws:
            _winner, drawn, smallest = _draw(
                base, base, 0, vocab, temperature, step_key, cut, top, best, min_p, flat,
                normal, BLOCK, False, PRECISE,
            )  # fmt: skip

    if PDL:  # the next kernel may start
        tl.extra.cuda.gdc_launch_dependents()
    greedy = tl.where(has_nan, nan_at, first_max)
    token = tl.where(seeded, drawn, greedy)
    tl.store(tokens_ptr + row, tl.where(live, token, 0).to(tl.int64))
    truncates = use_k | use_p
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
    device = scores.device
    tokens = torch.empty(rows, dtype=torch.long, device=device)
    cut = torch.empty(rows, dtype=torch.float32, device=device)
    if not rows:
        return tokens, cut
    counter = generated.reshape(-1)
    chunk = BLOCK * CHUNK_BLOCKS
    chunks = triton.cdiv(vocab, chunk)
    # partial results, each written before it is read (per call: a graph keeps its own)
    extremes = (
        torch.empty(rows, chunks, 3, dtype=torch.float32, device=device),
        torch.empty(rows, chunks, 3, dtype=torch.int32, device=device),
    )
    states = torch.empty(2, rows, STATE, dtype=torch.int32, device=device)
    counts = torch.empty(2, rows, chunks, PIVOTS + 2, dtype=torch.int32, device=device)
    masses = torch.empty(2, rows, chunks, PIVOTS + 1, dtype=torch.float32, device=device)
    gathered = (
        torch.empty(rows, GATHER, dtype=torch.float32, device=device),
        torch.empty(rows, GATHER, dtype=torch.int32, device=device),
    )
    draws = (
        torch.empty(rows, chunks, 2, dtype=torch.float32, device=device),
        torch.empty(rows, chunks, dtype=torch.int32, device=device),
    )
    row = (
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
        *extremes,
    )
    pdl = launch.dependent(device)
    shapes = {
        "BLOCK": BLOCK,
        "PIVOTS": PIVOTS,
        "VALUE_PASSES": VALUE_PASSES,
        "CHUNKS_P2": triton.next_power_of_2(chunks),
        "GATHER": GATHER,
    }
    options = {"PDL": pdl, "num_warps": NUM_WARPS, "launch_pdl": pdl}
    split = (rows, chunks)
    _extremes[split](
        *row, *draws, vocab, chunk, BLOCK=BLOCK, PRECISE=not INTERPRETED, **options
    )  # fmt: skip
    for n in range(SEARCH_LAUNCHES):  # a pass reads the last one's tallies, writes the other
        before, after = (n + 1) % 2, n % 2
        _search_pass[split](
            *row, states[before], counts[before], masses[before], states[after],
            counts[after], masses[after], *gathered, vocab, chunk, FIRST=n == 0,
            SEARCH_BLOCK=SEARCH_BLOCK, **shapes, **options,
        )  # fmt: skip
    last = (SEARCH_LAUNCHES - 1) % 2
    _draw_pass[split](
        *row, states[last], counts[last], masses[last], *draws, vocab, chunk,
        PRECISE=not INTERPRETED, **shapes, **options,
    )  # fmt: skip
    _finish[(rows,)](
        *row, states[last], counts[last], masses[last], *gathered, *draws, tokens, cut, vocab,
        chunks, SEARCH_BLOCK=SEARCH_BLOCK, PRECISE=not INTERPRETED, **shapes, **options,
    )  # fmt: skip
    return tokens, cut


@truncated_draw.register_fake
def _(scores, temperature, top_k, top_p_floor, min_p, sample, seeded, key, finished, generated):
    rows = scores.shape[0]
    return scores.new_empty(rows, dtype=torch.long), scores.new_empty(rows)
