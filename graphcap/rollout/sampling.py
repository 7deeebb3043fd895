"""Token selection with transformers' generate() math, per row, written to run inside a graph.

Every sampling setting (greedy or sample, temperature, top-k, top-p, min-p, repetition penalty,
min_new_tokens, seed, log-prob mode) is a per-row device tensor of :class:`RowSettings`, written
before each call, so one captured step serves any mix of settings, also within one batch. A few
facts shape the graph (:class:`SamplerShape`), so a step pays only for what some row of the
engine has used (sampling at all, the shared generator's draw, the keyed draw, log-probs,
penalties) and for truncation only where some row of the call itself truncates: top-k, top-p
and min-p here sort each row once (:func:`truncated`). A backend may offer a fused kernel that
truncates and draws without sorting (:meth:`~graphcap.backend.Backend.truncated_draw`; the
CUDA plugin's is Triton); this module's math is then its reference and fallback.

The order and the arithmetic follow ``generate`` (repetition penalty, min_new_tokens,
temperature, top-k, top-p, min-p). Two ways to draw (``RolloutConfig.draws``, docs/rollout.md):
``"generate"`` draws ``multinomial(softmax(scores), 1)`` over all rows from the shared
generator, exactly as generate does, so samples equal generate's for a fixed seed;
``"per_row"`` (the default) draws every sampled row from its own counter-based stream, a hash of
(key, sample index, token index, token id) with Gumbel-max selection: one pass over the
scores, reproducible, and independent of the other rows of the batch. A row's key is its own
``seed``, or, for an unseeded row, one number drawn from the shared generator per call plus
the row's prompt index. One deliberate difference from generate: the repetition penalty looks
only at written positions (prompt and generated tokens), never at left-pad slots.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from graphcap.rollout.exact import row_log_softmax
from graphcap.rollout.settings.sampling_params import LOGPROBS_MODES, SamplingParams

if TYPE_CHECKING:
    from graphcap.backend import Backend, TruncatedDraw

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9


@dataclass(frozen=True)
class SamplerShape:
    """What the sampler adds to a step: facts that grow per engine, and those each call decides
    for itself (truncation, the records).

    ``samples``: the step contains the sampling branch; a greedy-only engine never pays for
    it, and the first call with a sampled row captures once more (from then on every call,
    greedy or not, replays that graph). ``truncates``: the step runs top-k, top-p and min-p
    in the core's math (:func:`truncated`, one sort), because some sampled row of *this call*
    uses one; it adds no buffer, so the engine keeps a graph of each value and a call replays
    the one its rows need (a step with a backend's fused kernel truncates inside the kernel
    and leaves it off, unless it records scores, which the core's math gives). ``shared``:
    some sampled row drew from the shared generator (``multinomial`` over all rows,
    generate's own numbers); ``keyed``: some sampled row drew from its own hash stream.
    ``logprobs``: the step computes log-probs; ``drawn_logprobs``: of the distribution a
    row's token was drawn from (``logprobs_mode="sampling"``, the default; likewise), which
    alone needs the warped scores beside a shared draw. ``penalty`` / ``min_new``: the step applies
    the repetition penalty / blocks stop ids before ``min_new_tokens`` (some row had one;
    likewise); ``output_penalty``: vLLM's presence and frequency penalties (likewise);
    ``top_logprobs``: how many alternatives per token the step records (the most any call
    asked for; a call asking fewer reads the first ones). ``record_scores`` /
    ``record_logits``: the step records every step's scores / logits; like truncation these
    are the call's own, never grown (a call that asks for no records writes none and may take
    the ladder, whatever an earlier call asked). ``stops``: (sequences, longest) of the
    stop-sequence table the step matches against, (0, 0) = none; a call's own list is written
    into it, so only a longer or larger list recaptures.
    """

    samples: bool = False
    truncates: bool = False
    shared: bool = False
    keyed: bool = False
    logprobs: bool = False
    drawn_logprobs: bool = False
    penalty: bool = False
    min_new: bool = False
    record_scores: bool = False
    record_logits: bool = False
    stops: tuple[int, int] = (0, 0)
    output_penalty: bool = False
    top_logprobs: int = 0

    @property
    def records(self) -> bool:
        """Whether the step records every step's scores or logits (``(B, L, V)`` float32)."""
        return self.record_scores or self.record_logits

    def widen(self, rows: Sequence[SamplingParams], fused: bool = False) -> SamplerShape:
        """The shape that serves both what this one served and every row of ``rows``, with
        truncation only where some sampled row of ``rows`` truncates and the step has no
        fused kernel (``fused``) to do it, and the records ``rows`` ask for."""
        sampled = [p for p in rows if p.do_sample]
        record_scores = any(p.output_scores for p in rows)
        record_logits = any(p.output_logits for p in rows)
        records = record_scores or record_logits
        return SamplerShape(
            samples=self.samples or bool(sampled),
            truncates=any(truncates(p) for p in sampled) and (records or not fused),
            shared=self.shared or any(p.seed is None for p in sampled),
            keyed=self.keyed or any(p.seed is not None for p in sampled),
            logprobs=self.logprobs or any(p.return_logprobs for p in rows),
            drawn_logprobs=self.drawn_logprobs
            or any(p.return_logprobs and p.logprobs_mode == "sampling" for p in rows),
            penalty=self.penalty or any(p.repetition_penalty != 1.0 for p in rows),
            min_new=self.min_new or any(p.min_new_tokens > 0 for p in rows),
            record_scores=record_scores,
            record_logits=record_logits,
            top_logprobs=max([self.top_logprobs, *(p.top_logprobs for p in rows)]),
            output_penalty=self.output_penalty
            or any(p.presence_penalty or p.frequency_penalty for p in rows),
            stops=(
                max([self.stops[0], *(len(p.stop_sequences or ()) for p in rows)]),
                max([self.stops[1], *(len(q) for p in rows for q in p.stop_sequences or ())]),
            ),
        )

    @property
    def per_engine(self) -> SamplerShape:
        """This shape without what each call decides for itself (truncation): the member of
        the graph signature, so calls that differ only there share the step's buffers."""
        return replace(self, truncates=False)

    def describe(self) -> str:
        """The facts that are set, e.g. ``"samples, truncates, keyed"`` (``"greedy"``)."""
        facts = [
            f.name if v is True else f"{f.name}={v}"
            for f in fields(self)
            if (v := getattr(self, f.name)) not in (False, 0, (0, 0))
        ]
        return ", ".join(facts) or "greedy"


def truncates(params: SamplingParams) -> bool:
    """Whether a sampled row keeps only part of the vocabulary (top-k, top-p or min-p)."""
    return params.effective_top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


@dataclass(frozen=True)
class RowPlan:
    """The settings of each batch row of one call (host side), and the call's stop ids."""

    params: tuple[SamplingParams, ...]  # one per batch row (samples of a prompt adjacent)
    samples: tuple[int, ...]  # each row's sample index within its prompt
    active: int  # rows from here on are bucket padding

    @classmethod
    def build(cls, per_prompt: Sequence[SamplingParams], repeats: int, batch_size: int) -> RowPlan:
        """Expand per-prompt settings to ``repeats`` samples each, then pad to ``batch_size``
        with copies of the last row (padding rows start finished and only ever emit pad)."""
        params = [p for p in per_prompt for _ in range(repeats)]
        samples = [j for _ in per_prompt for j in range(repeats)]
        active = len(params)
        params += [params[-1]] * (batch_size - active)
        samples += [0] * (batch_size - active)
        return cls(tuple(params), tuple(samples), active)

    @property
    def draws(self) -> bool:
        """Whether any real row samples from the shared generator (sampled, no seed)."""
        return any(p.do_sample and p.seed is None for p in self.params[: self.active])

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.params[0].stop_ids

    @property
    def stop_sequences(self) -> tuple[tuple[int, ...], ...]:
        return self.params[0].stop_sequences or ()

    @property
    def keep_stop_sequences(self) -> bool:
        return self.params[0].include_stop_str_in_output


def keyed_rows(per_prompt: Sequence[SamplingParams], key: int) -> list[SamplingParams]:
    """``per_prompt`` with every unseeded sampled prompt given its own stream: prompt ``i``
    draws from ``key + i`` (``key`` is drawn once per call from the shared generator, so the
    generator's seed still decides the call). Each row then draws what it would in any batch."""
    return [
        replace(p, seed=(key + i) % 2**64) if p.do_sample and p.seed is None else p
        for i, p in enumerate(per_prompt)
    ]


def call_key(generator: torch.Generator | None, device: torch.device) -> int:
    """One number from the shared generator (``generator``, else the device's default): the
    key of a call's unseeded rows under ``draws="per_row"``. One host read, outside graphs."""
    return int(torch.randint(0, 2**62, (1,), device=device, generator=generator).item())


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in ``[0, 2**32)``.

    Products are split into 16-bit halves so no intermediate exceeds 2**49: well defined on
    every backend (no reliance on wrapping signed overflow).
    """
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def row_key(seed: int, sample: int) -> int:
    """The 32-bit key of a seeded row's stream: a hash of its seed and sample index."""
    words = torch.tensor([seed & MASK32, seed >> 32, (sample + GOLDEN32) & MASK32])
    h = hash32(words)
    return int(hash32(hash32(h[0:1] ^ h[1:2]) ^ h[2:3]))


@dataclass
class RowSettings:
    """Per-row device inputs of the sampler, shape ``(B,)``; written per call, read by replays."""

    sample: torch.Tensor  # bool: sampled (else greedy)
    seeded: torch.Tensor  # bool: draws from its hash stream (else the shared generator)
    key: torch.Tensor  # long: 32-bit hash key of (seed, sample index)
    temperature: torch.Tensor  # float32: warper temperature (1 for greedy rows)
    top_k: torch.Tensor  # long: 0 = off
    top_p_floor: torch.Tensor  # float32: 1 - top_p, computed in double as generate does
    min_p: torch.Tensor  # float32: 0 = off
    penalty: torch.Tensor  # float32: repetition penalty (1 = off)
    presence: torch.Tensor  # float32: presence penalty (0 = off)
    frequency: torch.Tensor  # float32: frequency penalty (0 = off)
    min_new: torch.Tensor  # long: min_new_tokens
    logprobs_mode: torch.Tensor  # long: index into LOGPROBS_MODES
    logprob_temperature: torch.Tensor  # float32: the row's temperature, greedy rows too
    token_mix: torch.Tensor  # (V,) long: hash32 of each token id (fixed)

    @classmethod
    def allocate(cls, batch_size: int, vocab_size: int, device: torch.device) -> RowSettings:
        def full(value: float | int | bool, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((batch_size,), value, dtype=dtype, device=device)

        tokens = torch.arange(vocab_size, dtype=torch.long, device=device)
        return cls(
            sample=full(False, torch.bool),
            seeded=full(False, torch.bool),
            key=full(0, torch.long),
            temperature=full(1.0, torch.float32),
            top_k=full(0, torch.long),
            top_p_floor=full(0.0, torch.float32),
            min_p=full(0.0, torch.float32),
            penalty=full(1.0, torch.float32),
            presence=full(0.0, torch.float32),
            frequency=full(0.0, torch.float32),
            min_new=full(0, torch.long),
            logprobs_mode=full(0, torch.long),
            logprob_temperature=full(1.0, torch.float32),
            token_mix=hash32((tokens + GOLDEN32) & MASK32),
        )

    def row_tensors(self) -> list[torch.Tensor]:
        """The ``(B,)`` settings (what moves with a row; the token table does not)."""
        return [t for f in fields(self) if f.name != "token_mix" for t in [getattr(self, f.name)]]

    def leading(self, rows: int) -> RowSettings:
        """The first ``rows`` rows' settings, as views (a step of a smaller batch size)."""
        narrowed = {f.name: getattr(self, f.name)[:rows] for f in fields(self)}
        return RowSettings(**{**narrowed, "token_mix": self.token_mix})

    def write(
        self,
        params: Sequence[SamplingParams],
        samples: Sequence[int],
        rows: torch.Tensor | None = None,
    ) -> None:
        """Set rows ``rows`` (all when ``None``) to ``params`` / sample indices (host -> device
        copies, outside any graph). Greedy rows get neutral warpers, as generate ignores them;
        top-k is clamped to the vocabulary, as generate clamps it (``top_k=2**63`` keeps all)."""
        vocab = self.token_mix.shape[0]
        values = {
            "sample": [p.do_sample for p in params],
            "seeded": [p.do_sample and p.seed is not None for p in params],
            "key": [
                0 if p.seed is None else row_key(p.seed, j)
                for p, j in zip(params, samples, strict=True)
            ],
            "temperature": [p.temperature if p.do_sample else 1.0 for p in params],
            "top_k": [min(p.effective_top_k, vocab) for p in params],
            "top_p_floor": [1.0 - p.top_p if p.do_sample else 0.0 for p in params],
            "min_p": [p.min_p if p.do_sample else 0.0 for p in params],
            "penalty": [p.repetition_penalty for p in params],
            "presence": [p.presence_penalty for p in params],
            "frequency": [p.frequency_penalty for p in params],
            "min_new": [p.min_new_tokens for p in params],
            "logprobs_mode": [LOGPROBS_MODES.index(p.logprobs_mode) for p in params],
            "logprob_temperature": [p.temperature for p in params],
        }
        for name, column in values.items():
            target = getattr(self, name)
            source = torch.tensor(column, dtype=target.dtype).to(target.device)
            if rows is None:
                target.copy_(source)
            else:
                target[rows] = source


def repetition_penalty(
    scores: torch.Tensor, tokens: torch.Tensor, written: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """Penalise every token id present at a written position of ``tokens`` (B, L), per row.

    transformers' own method and math: gather the scores of the present ids, penalise them
    (``score < 0 ? score * p : score / p``; a penalty of 1 is exact identity) and scatter them
    back, so a repeated id is penalised once. It touches ``B x L`` scores, not ``B x V``.
    Unwritten or pad slots, which hold arbitrary ids, are routed to one extra column that is
    dropped, so they cannot collide with written ones.
    """
    vocab = scores.shape[-1]
    index = torch.where(written, tokens, vocab)
    widened = torch.nn.functional.pad(scores, (0, 1))
    present = widened.gather(1, index)
    p = penalty[:, None]
    widened.scatter_(1, index, torch.where(present < 0, present * p, present / p))
    return widened[:, :vocab]


def output_penalties(
    scores: torch.Tensor,
    tokens: torch.Tensor,
    response: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """vLLM's presence and frequency penalties, per row, over the generated tokens of
    ``tokens`` (B, L) (``response`` marks them; the prompt is not counted):
    ``score - frequency * count - presence * (count > 0)``. The counts come from the step's
    own buffers, so no counter has to be kept; other slots land in one dropped column."""
    vocab = scores.shape[-1]
    index = torch.where(response, tokens, vocab)
    counts = scores.new_zeros((scores.shape[0], vocab + 1))
    counts.scatter_add_(1, index, response.to(scores.dtype))
    counts = counts[:, :vocab]
    return scores - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def stops_blocked(
    stop_vocab: torch.Tensor, generated: torch.Tensor, min_new: torch.Tensor
) -> torch.Tensor:
    """(B, V) True at stop ids in rows that generated fewer than their ``min_new`` tokens
    (``generated`` is the step counter: one for all rows, or one per row)."""
    return stop_vocab[None, :] & (generated.view(-1) < min_new)[:, None]


def process_scores(
    logits: torch.Tensor,
    rows: RowSettings,
    tokens: torch.Tensor,
    written: torch.Tensor,
    response: torch.Tensor,
    stop_vocab: torch.Tensor,
    generated: torch.Tensor,
    shape: SamplerShape,
) -> torch.Tensor:
    """generate()'s logits processors (penalty, min_new_tokens), with vLLM's presence and
    frequency penalties after the repetition penalty (vLLM's order), on float32 scores: what
    greedy rows take the argmax of. A processor no row of the engine has used (``shape``) is
    skipped: it would be the identity for every row. After a penalty's fresh output the stop
    block is written in place, so one copy serves both."""
    scores = logits.float()
    if shape.penalty:
        scores = repetition_penalty(scores, tokens, written, rows.penalty)
    if shape.output_penalty:
        scores = output_penalties(scores, tokens, response, rows.presence, rows.frequency)
    if shape.min_new:
        blocked = stops_blocked(stop_vocab, generated, rows.min_new)
        fresh = shape.penalty or shape.output_penalty
        fill = scores.masked_fill_ if fresh else scores.masked_fill  # fresh, or logits'
        scores = fill(blocked, -float("inf"))
    return scores


def cumulative_sum(probs: torch.Tensor) -> torch.Tensor:
    """``probs.cumsum(-1)``, never compiled (compiled steps run it through
    :func:`~graphcap.rollout.plan.regions.eager_cumulative_sum`): torch 2.11's inductor fails to
    generate the split scan it picks for rows over 128 columns when the scan is fused with a
    broadcast (the softmax before it; pytorch issue 180221, fixed after 2.11). Eager, it is one
    kernel."""
    return probs.cumsum(dim=-1)


def warp(scores: torch.Tensor, rows: RowSettings, truncate: bool) -> torch.Tensor:
    """Temperature per row, then (``truncate``) top-k, top-p and min-p, each off where its
    setting is neutral. Without truncation no row needs the vocabulary in order, and the
    step never sorts it."""
    scores = scores / rows.temperature[:, None]
    return truncated(scores, rows) if truncate else scores


def truncated(scores: torch.Tensor, rows: RowSettings) -> torch.Tensor:
    """Top-k, top-p and min-p of temperature-scaled ``scores``, as generate keeps them.

    One ascending sort serves top-k and top-p: the k-th largest value is ``sorted[V - k]``, and
    the top-k-filtered scores sorted are the same sort with a prefix set to -inf, so top-p sees
    exactly the values (in the same order) that generate's own sort gives it.
    """
    neg_inf = -float("inf")
    vocab = scores.shape[-1]
    ordered, order = torch.sort(scores, descending=False)
    k = rows.top_k.clamp(max=vocab)
    kth = ordered.gather(1, (vocab - k.clamp(min=1))[:, None])
    use_k = (k > 0)[:, None]
    scores = scores.masked_fill(use_k & (scores < kth), neg_inf)
    ordered = ordered.masked_fill(use_k & (ordered < kth), neg_inf)
    cumulative = cumulative_sum(ordered.softmax(dim=-1))
    remove_sorted = cumulative <= rows.top_p_floor[:, None]
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    scores = scores.masked_fill(remove & (rows.top_p_floor > 0)[:, None], neg_inf)
    probs = scores.softmax(dim=-1)
    below = probs < rows.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return scores.masked_fill(below, neg_inf)


def sanitise(
    scores: torch.Tensor,
    finished: torch.Tensor,
    unwarped: torch.Tensor | None = None,
    unwarped_max: torch.Tensor | None = None,
) -> torch.Tensor:
    """Make every row a distribution ``multinomial`` accepts.

    A row whose warped ``scores`` lost their order (some ``+inf``: a tiny temperature; or every
    one ``-inf`` though ``unwarped`` has finite ones: a tiny temperature with every score
    negative) keeps only the tokens of its largest ``unwarped`` score: the argmax, the limit of
    its distribution. Without ``unwarped``, or where the unwarped scores overflowed too (a
    repetition penalty overflowing float32, an fp16 model's logits), the row draws uniformly
    among its ``+inf`` tokens; finished rows, and rows with NaN or nothing finite, get flat
    logits. A NaN, ``+inf`` or all-zero distribution reaching ``multinomial`` is a device-side
    assert on some devices. The replacement changes no other row's draw: ``multinomial(p, 1)``
    consumes the same random numbers whatever the values. Row maxima find every case: a
    maximum is NaN when the row holds a NaN, ``-inf`` when nothing is finite, ``+inf`` when a
    score overflowed (``unwarped_max``: the unwarped rows' maxima, where the caller has them).
    """
    neg_inf = -float("inf")
    top = scores.amax(dim=-1, keepdim=True)
    if unwarped is None:
        lost, keep = torch.isposinf(top), torch.isposinf(scores)
    else:
        best = unwarped.amax(dim=-1, keepdim=True) if unwarped_max is None else unwarped_max
        lost = torch.isposinf(top) | (torch.isneginf(top) & (best > neg_inf))
        keep = unwarped == best
    bad = finished[:, None] | torch.isnan(top) | (torch.isneginf(top) & ~lost)
    scores = torch.where(lost, torch.where(keep, 0.0, neg_inf), scores)
    return scores.masked_fill(bad, 0.0)


def gumbel(rows: RowSettings, generated: torch.Tensor) -> torch.Tensor:
    """Gumbel noise (B, V) from each row's hash stream at its token index ``generated``.

    ``-log(E)`` with ``E = -log1p(-u)`` exponential: u near 0 (E small, the draws that decide a
    winner) keeps full float32 precision.
    """
    counter = hash32((generated.view(-1) + GOLDEN32) & MASK32)
    step_key = hash32(rows.key ^ counter)
    bits = hash32(step_key[:, None] ^ rows.token_mix[None, :])
    u = ((bits.float() + 0.5) * 2.0**-32).clamp(max=1.0 - 2.0**-24)
    return -torch.log(-torch.log1p(-u))


#: Columns per chunk of :func:`argmax_rows`'s first pass.
ARGMAX_CHUNK = 1024


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(scores, dim=-1)`` of (B, V) scores in two passes: the maximum of each
    chunk of :data:`ARGMAX_CHUNK` columns, then the first chunk that holds the row's maximum.
    The index is one pass's (maxima are exact, and both passes take the first of equal
    values), but the first pass spreads a row over many programs where one pass reads a row
    with one program, which leaves most of a device idle at batch 1 (docs/decisions.md)."""
    rows, vocab = scores.shape
    chunks = vocab // ARGMAX_CHUNK
    if chunks < 2:
        return torch.argmax(scores, dim=-1)
    split = chunks * ARGMAX_CHUNK
    head = scores[:, :split].reshape(rows, chunks, ARGMAX_CHUNK).max(dim=-1)
    starts = torch.arange(0, split, ARGMAX_CHUNK, device=scores.device)
    values, where = head.values, head.indices + starts
    if split < vocab:
        tail = scores[:, split:].max(dim=-1, keepdim=True)
        values = torch.cat([values, tail.values], dim=1)
        where = torch.cat([where, tail.indices + split], dim=1)
    return where.gather(1, values.argmax(dim=-1, keepdim=True)).squeeze(1)


class Selection(NamedTuple):
    """What :func:`select` chose: the token per row, the scores of the distribution it was
    chosen from (``None`` where the step computes no log-probs) and which rows' scores held a
    NaN (drawn from flat scores instead)."""

    tokens: torch.Tensor
    drawn_from: torch.Tensor | None
    nan_rows: torch.Tensor


def select(
    scores: torch.Tensor,
    rows: RowSettings,
    finished: torch.Tensor,
    generated: torch.Tensor,
    generator: torch.Generator | None,
    shape: SamplerShape,
    draw: TruncatedDraw | None = None,
) -> Selection:
    """The chosen token per row, the scores of the distribution it was chosen from (where
    ``shape.logprobs``), and the rows whose scores held a NaN.

    Greedy rows: argmax of ``scores`` (the processed scores, bitwise). Sampled rows: warped,
    then the keyed draw (Gumbel-max over the row's hash stream) where the row has a key, else
    one ``multinomial`` draw over all rows from the shared generator (as generate draws, so it
    consumes the generator identically). ``draw``: a backend's fused kernel
    (:meth:`~graphcap.backend.Backend.truncated_draw`), which chooses greedy and keyed rows'
    tokens and gives each row's cut; the warped scores are then built from the cuts, only
    where the shared draw or the log-probs read them. Without it, greedy and keyed rows share
    one argmax pass; ``shape`` leaves out what no row of the step uses.
    """
    if draw is not None:
        chosen, cut = draw(
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
        nan_rows = torch.isnan(cut)
        warped = None
        if shape.shared or shape.drawn_logprobs:
            scaled = scores / rows.temperature[:, None]
            kept = scaled.masked_fill(scaled < cut[:, None], -float("inf"))
            warped = sanitise(kept, finished, scores)
    else:
        best = scores.amax(dim=-1, keepdim=True)
        nan_rows = torch.isnan(best).squeeze(1)
        warped = sanitise(warp(scores, rows, shape.truncates), finished, scores, best)
        if shape.keyed:
            noisy = warped + gumbel(rows, generated)
            chosen = argmax_rows(torch.where(rows.seeded[:, None], noisy, scores))
        else:
            chosen = argmax_rows(scores)
    if shape.shared:
        drawn = torch.multinomial(warped.softmax(dim=-1), 1, generator=generator).squeeze(1)
        chosen = torch.where(rows.sample & ~rows.seeded, drawn, chosen)
    drawn_from = torch.where(rows.sample[:, None], warped, scores) if shape.drawn_logprobs else None
    return Selection(chosen, drawn_from, nan_rows)


def logprob_distribution(
    drawn_from: torch.Tensor | None, logits: torch.Tensor, rows: RowSettings
) -> torch.Tensor:
    """(B, V) log-probs under the row's ``logprobs_mode``: the distribution the token was
    drawn from (``drawn_from``; ``None`` where no row of the step asks for it), ``log_softmax(
    logits / T)``, or ``log_softmax(logits)``. "raw" divides by 1 (exact), so one division
    (of the logits as float32, in the same pass) and one selection serve the three modes.
    Trainer-exact calls take the backend's ``log_softmax``
    (:func:`graphcap.rollout.exact.row_log_softmax`)."""
    mode = rows.logprobs_mode[:, None]
    divisor = torch.where(mode == 1, rows.logprob_temperature[:, None], 1.0)
    source = logits / divisor  # float32: the divisor's dtype
    if drawn_from is not None:
        source = torch.where(mode == 0, drawn_from, source)
    return row_log_softmax(source)


@contextmanager
def generator_kept(
    backend: Backend, generator: torch.Generator | None, keep: bool
) -> Iterator[None]:
    """Put the shared generator (``generator``, else the backend's) back as it was after a call
    in which no row drew from it: a sampling graph draws for every row, but greedy and seeded
    calls must leave the training side's RNG untouched."""
    if not keep:
        yield
        return
    state = generator.get_state() if generator is not None else backend.get_rng_state()
    try:
        yield
    finally:
        if generator is not None:
            generator.set_state(state)
        else:
            backend.set_rng_state(state)
