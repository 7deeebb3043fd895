"""The decode step: one function that the eager loop calls and the graph path captures.

All state the step reads or advances lives in :class:`DecodeState` device tensors (input token,
position ids, step counter, finished flags, output buffers, the per-row sampling settings and the
stop-id table, both written per call) plus the cache's write positions and the mask's valid
columns. The step issues no host read, so a replay does exactly what a call
does; the host looks only at ``all_finished``, every ``eos_check_interval`` steps.

Columns: the cache column of a row's latest token is ``cache.write_pos``; a chosen token is
written to ``sequences`` at that column, then the next step feeds it to the model, which writes
its K/V there and advances ``write_pos``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, TypeAlias

import torch
from transformers.cache_utils import Cache

from graphcap.rollout.cache import LayerSpec, SpanView, StaticKVCache
from graphcap.rollout.cache.blocks import BlockKVCache, whole_table_blocks
from graphcap.rollout.cache.masks import MaskBuffers
from graphcap.rollout.plan.signature import attention_implementation
from graphcap.rollout.prefill import accepts_logits_to_keep, cache_keyword
from graphcap.rollout.sampling import (
    RowPlan,
    RowSettings,
    SamplerShape,
    argmax_rows,
    logprob_distribution,
    process_scores,
    select,
    warp,
)

if TYPE_CHECKING:
    from graphcap.backend import TruncatedDraw
    from graphcap.rollout.plan import Plan
    from graphcap.rollout.settings.call import CallSettings

MaskInput: TypeAlias = "torch.Tensor | dict[str, torch.Tensor]"


@dataclass
class DecodeState:
    """Device buffers of one batch shape ``(B, L)``; allocated once, reset per call."""

    sequences: torch.Tensor  # (B, L) long: prompt, then generated tokens, pad elsewhere
    response: torch.Tensor  # (B, L) bool: generated columns up to and including EOS
    logprobs: torch.Tensor  # (B, L) float32: log-prob of the chosen token at its column
    tokens: torch.Tensor  # (B, 1) long: the token the next forward consumes
    positions: torch.Tensor  # (B, 1) long: its position id
    generated: torch.Tensor  # () long: tokens chosen so far in this call; (B, 1) per row
    finished: torch.Tensor  # (B,) bool
    all_finished: torch.Tensor  # () bool: the one value the host reads
    nan_draws: torch.Tensor  # () long: tokens sampled for live rows whose logits held NaN
    stop_vocab: torch.Tensor  # (V,) bool: True at the call's EOS and stop_token_ids
    pad: torch.Tensor  # () long
    rows: RowSettings  # per-row sampling settings (written per call)
    #: (B, L, V) float32, at the index of each chosen token: the processed scores and the raw
    #: logits it was chosen from (only when the sampler shape records them; see ``record``)
    scores: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    #: (S, T) long: the call's stop sequences, right-aligned, -1 before each (only when the
    #: sampler shape matches them; see ``match_stops``); written per call, read by replays
    stop_table: torch.Tensor | None = None
    stop_keep: torch.Tensor | None = None  # () bool: matched tokens stay in the response
    stop_hit: torch.Tensor | None = None  # (B,) long: the stop sequence that ended a row, -1
    #: (B, L, K): the K most likely tokens' log-probs and ids at each chosen token's column
    #: (only when the sampler shape records alternatives; see ``alternatives``)
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        batch_size: int,
        total_len: int,
        vocab_size: int,
        eos_ids: tuple[int, ...],
        pad_id: int,
        device: torch.device,
    ) -> DecodeState:
        long = {"dtype": torch.long, "device": device}
        state = cls(
            sequences=torch.zeros((batch_size, total_len), **long),
            response=torch.zeros((batch_size, total_len), dtype=torch.bool, device=device),
            logprobs=torch.zeros((batch_size, total_len), dtype=torch.float32, device=device),
            tokens=torch.zeros((batch_size, 1), **long),
            positions=torch.zeros((batch_size, 1), **long),
            generated=torch.zeros((), **long),
            finished=torch.zeros(batch_size, dtype=torch.bool, device=device),
            all_finished=torch.zeros((), dtype=torch.bool, device=device),
            nan_draws=torch.zeros((), **long),
            stop_vocab=torch.zeros(vocab_size, dtype=torch.bool, device=device),
            pad=torch.full((), pad_id, **long),
            rows=RowSettings.allocate(batch_size, vocab_size, device),
        )
        state.set_stop_ids(eos_ids)
        return state

    #: the buffers with one row per batch row, beside ``rows`` (None where not allocated)
    ROW_FIELDS = (
        "sequences",
        "response",
        "logprobs",
        "tokens",
        "positions",
        "finished",
        "scores",
        "logits",
        "stop_hit",
        "top_values",
        "top_ids",
    )

    def _row_fields(self) -> list[str]:
        """The fields allocated with one row per batch row; the step counter is one of them
        where each row counts its own tokens (the continuous path's ``(B, 1)`` counter)."""
        names = [name for name in self.ROW_FIELDS if getattr(self, name) is not None]
        return names + (["generated"] if self.generated.dim() else [])

    def row_tensors(self) -> list[torch.Tensor]:
        """Every tensor with one row per batch row (what moves with a row)."""
        present = [getattr(self, name) for name in self._row_fields()]
        return present + self.rows.row_tensors()

    def leading(self, rows: int) -> DecodeState:
        """The first ``rows`` rows, as views of the same buffers; the counters, flags and
        tables every row shares are the same tensors."""
        narrowed = {name: getattr(self, name)[:rows] for name in self._row_fields()}
        return replace(self, **narrowed, rows=self.rows.leading(rows))

    def record(self, scores: bool, logits: bool) -> None:
        """Allocate the records asked for (once per step shape): the scores and / or the
        logits, each ``(B, L, V)`` float32."""
        shape = (*self.sequences.shape, self.stop_vocab.shape[0])
        device = self.sequences.device
        if scores:
            self.scores = torch.zeros(shape, dtype=torch.float32, device=device)
        if logits:
            self.logits = torch.zeros(shape, dtype=torch.float32, device=device)

    def alternatives(self, count: int) -> None:
        """Allocate the top-``count`` log-prob records (once per step shape)."""
        shape = (*self.sequences.shape, count)
        device = self.sequences.device
        self.top_values = torch.zeros(shape, dtype=torch.float32, device=device)
        self.top_ids = torch.zeros(shape, dtype=torch.long, device=device)

    def stop_sequence_table(self, sequences: int, longest: int) -> None:
        """Allocate the stop-sequence table (once per step shape)."""
        device = self.sequences.device
        self.stop_table = torch.full((sequences, longest), -1, dtype=torch.long, device=device)
        self.stop_keep = torch.zeros((), dtype=torch.bool, device=device)
        self.stop_hit = torch.full_like(self.finished, -1, dtype=torch.long)

    def set_stop_sequences(self, sequences: tuple[tuple[int, ...], ...], keep: bool) -> None:
        """The call's stop sequences and ``include_stop_str_in_output``; outside any graph.
        Unused table rows stay all -1, which never matches."""
        if self.stop_table is None:
            assert not sequences, "the sampler shape sizes the table for every call"
            return
        longest = self.stop_table.shape[1]
        table = [[-1] * (longest - len(seq)) + list(seq) for seq in sequences]
        table += [[-1] * longest] * (self.stop_table.shape[0] - len(table))
        self.stop_table.copy_(torch.tensor(table, dtype=torch.long))
        self.stop_keep.fill_(keep)

    def match_stops(self, column: torch.Tensor) -> None:
        """End rows whose generated tokens now end with a stop sequence, on the device.

        ``column`` (B, 1): where each row's latest token was written. The window of the last
        ``T`` columns is compared with every table row; only generated tokens count (never the
        prompt), and not before the row has ``min_new_tokens`` tokens (vLLM's rule). Without
        ``stop_keep`` the matched tokens leave the response (pad in ``sequences``).
        """
        table = self.stop_table
        filler = table < 0
        offsets = torch.arange(1 - table.shape[1], 1, device=table.device)
        index = column + offsets
        inside = index >= 0
        index = index.clamp(min=0)
        window = self.sequences.gather(1, index)
        ours = self.response.gather(1, index) & inside
        equal = (window[:, None, :] == table) & ours[:, None, :]
        hits = (equal | filler).all(-1) & ~filler.all(-1)  # (B, S)
        allowed = self.generated.view(-1) + 1 >= self.rows.min_new
        hit = hits.any(-1) & allowed
        which = hits.to(torch.long).argmax(-1)
        self.stop_hit.copy_(torch.where(hit, which, self.stop_hit))
        length = (~filler).sum(-1)[which]
        columns = torch.arange(self.sequences.shape[1], device=table.device)
        drop = (
            (hit & ~self.stop_keep)[:, None]
            & (columns > column - length[:, None])
            & (columns <= column)
        )
        self.response.masked_fill_(drop, False)
        self.sequences.masked_fill_(drop, self.pad)
        self.logprobs.masked_fill_(drop, 0.0)
        if self.top_values is not None:
            self.top_values.masked_fill_(drop[..., None], 0.0)
            self.top_ids.masked_fill_(drop[..., None], 0)
        self.finished.logical_or_(hit)

    def set_stop_ids(self, ids: tuple[int, ...]) -> None:
        """The ids that end a row (EOS and ``stop_token_ids``); outside any graph."""
        self.stop_vocab.zero_()
        if ids:
            index = torch.tensor(ids, dtype=torch.long).to(self.stop_vocab.device)
            self.stop_vocab[index] = True

    def configure(self, row_plan: RowPlan, rows: torch.Tensor | None = None) -> None:
        """Write ``row_plan``'s sampling settings into rows ``rows`` (all when ``None``; then
        ``row_plan`` has one entry per row) and its stop ids; outside any graph."""
        self.rows.write(row_plan.params, row_plan.samples, rows)
        self.set_stop_ids(row_plan.stop_ids)
        self.set_stop_sequences(row_plan.stop_sequences, row_plan.keep_stop_sequences)

    def reset(
        self, prompt_ids: torch.Tensor, next_positions: torch.Tensor, row_plan: RowPlan
    ) -> None:
        """Start a call: prompt in the first columns, pad after, counters and flags cleared,
        each row's sampling settings from ``row_plan``.

        Rows from ``row_plan.active`` on (bucket padding) start finished: they only ever emit pad.
        """
        self.configure(row_plan)
        width = prompt_ids.shape[-1]
        self.sequences.copy_(self.pad.expand_as(self.sequences))
        self.sequences[:, :width].copy_(prompt_ids)
        self.response.zero_()
        self.logprobs.zero_()
        if self.top_values is not None:
            self.top_values.zero_()
            self.top_ids.zero_()
        self.positions.copy_(next_positions.view(-1, 1))
        self.tokens.zero_()
        self.generated.zero_()
        self.finished.zero_()
        self.finished[row_plan.active :] = True
        self.all_finished.zero_()
        self.nan_draws.zero_()
        if self.stop_hit is not None:
            self.stop_hit.fill_(-1)


class DecodeStep:
    """The model's decode step bound to its state; ``commit`` also serves the prefill token."""

    #: Cache columns ``[lo, hi)`` the model attends over, as host ints (frozen into a captured
    #: graph); ``None`` = the whole buffer. Per-position graphs attend over the written columns
    #: only; the eager continuous layout modes over the live ones.
    span: tuple[int, int] | None = None

    def __init__(
        self,
        model: torch.nn.Module,
        cache: StaticKVCache | BlockKVCache,
        masks: MaskBuffers,
        state: DecodeState,
        sampler: SamplerShape,
        generator: torch.Generator | None,
        draw: TruncatedDraw | None = None,
    ):
        """``sampler`` shapes the step: the sampling branch, log-probs, the processors.
        ``draw``: the backend's fused truncation and draw, where it offers one."""
        self.model = model
        self.cache = cache
        self.masks = masks
        self.state = state
        self.sampler = sampler
        self.generator = generator
        self.draw = draw
        self._extra = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
        self._cache_keyword = cache_keyword(model)

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        specs: tuple[LayerSpec, ...],
        plan: Plan,
        vocab_size: int,
        settings: CallSettings,
        generator: torch.Generator | None,
        kv_memory: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> DecodeStep:
        """A step with fresh buffers for ``plan``'s signature, sized from ``specs`` (the K/V
        shapes the prefill produced); its K/V buffers (those alone) allocated within
        ``kv_memory()``, now and when a block pool grows."""
        sig = plan.signature
        device, batch, total = sig.device, sig.batch_size, sig.total_len
        cache: StaticKVCache | BlockKVCache
        if sig.kv_block_size is None:
            cache = StaticKVCache(specs, batch, total, memory=kv_memory)
        else:
            size = sig.kv_block_size
            blocks = whole_table_blocks(batch, total, size) if cls.pool_for_bucket else None
            cache = BlockKVCache(specs, batch, total, size, num_blocks=blocks, memory=kv_memory)
        masks = MaskBuffers.for_model(
            model.config, batch, total, sig.dtype, device, plan.windows, sig.mask_form
        )
        eos, pad = settings.eos_ids, settings.pad_token_id
        state = cls.allocate_state(batch, total, vocab_size, eos, pad, device)
        if sig.sampler.records:
            state.record(sig.sampler.record_scores, sig.sampler.record_logits)
        if sig.sampler.top_logprobs:
            state.alternatives(sig.sampler.top_logprobs)
        if sig.sampler.stops != (0, 0):
            state.stop_sequence_table(*sig.sampler.stops)
        return cls(model, cache, masks, state, sig.sampler, generator, plan.draw)

    allocate_state = staticmethod(DecodeState.allocate)
    #: A block table's pool holds every row's whole table from the start: a call's rows all
    #: write the same columns, so some call of a length bucket needs all of it, and a pool
    #: grown later would drop the bucket's graph (each bucket is one graph, captured once).
    pool_for_bucket: ClassVar[bool] = True

    def mutable_tensors(self) -> list[torch.Tensor]:
        """Everything a step writes except the K/V buffers."""
        s = self.state
        return [
            s.sequences,
            s.response,
            s.logprobs,
            s.tokens,
            s.positions,
            s.generated,
            s.finished,
            s.all_finished,
            s.nan_draws,
            *self.cache.step_tensors(),
            self.masks.valid,
            *self.masks.outputs.values(),
            *([s.stop_hit] if s.stop_hit is not None else []),
            *([s.top_values, s.top_ids] if s.top_values is not None else []),
        ]

    def commit(self, logits: torch.Tensor) -> None:
        """Choose the next token from last-position ``logits`` (B, V) and record it."""
        s = self.state
        scores = process_scores(
            logits,
            s.rows,
            s.sequences,
            self.masks.valid,
            s.response,
            s.stop_vocab,
            s.generated,
            self.sampler,
        )
        if self.sampler.samples:
            chosen, drawn_from, nan_rows = select(
                scores, s.rows, s.finished, s.generated, self.generator, self.sampler, self.draw
            )
            # the sampler draws a NaN row uniformly (it must not reach multinomial): count it
            s.nan_draws.add_((nan_rows & s.rows.sample & ~s.finished).sum())
        else:
            chosen = argmax_rows(scores)
            drawn_from = scores if self.sampler.drawn_logprobs else None
        token = torch.where(s.finished, s.pad, chosen)
        column = self.cache.write_pos[:, None]
        s.sequences.scatter_(1, column, token[:, None])
        s.response.scatter_(1, column, ~s.finished[:, None])
        if self.sampler.logprobs:
            dist = logprob_distribution(drawn_from, logits, s.rows)
            logp = dist.gather(1, chosen[:, None])
            s.logprobs.scatter_(1, column, logp.masked_fill(s.finished[:, None], 0.0))
            if s.top_values is not None:
                values, ids = dist.topk(s.top_values.shape[-1], dim=-1)
                idle = s.finished[:, None, None]
                at = column[:, :, None].expand(-1, 1, values.shape[-1])
                s.top_values.scatter_(1, at, values[:, None].masked_fill(idle, 0.0))
                s.top_ids.scatter_(1, at, ids[:, None].masked_fill(idle, 0))
        if self.sampler.record_scores:
            # what generate returns as scores: processed, warped where the row samples
            warped = (
                warp(scores, s.rows, self.sampler.truncates) if self.sampler.samples else scores
            )
            processed = torch.where(s.rows.sample[:, None], warped, scores)
            s.scores.index_copy_(1, s.generated.view(1), processed[:, None])
        if self.sampler.record_logits:
            s.logits.index_copy_(1, s.generated.view(1), logits.float()[:, None])
        if s.stop_table is not None:
            s.match_stops(column)
        s.finished.logical_or_(s.stop_vocab[token])
        s.tokens.copy_(token[:, None])
        s.generated.add_(1)
        s.all_finished.copy_(s.finished.all())

    def __call__(self) -> None:
        """One decode step: forward the latest token, then choose and record the next one."""
        s = self.state
        mask, cache = self._view(self.prepare())
        # the attention a capture swaps in decides whether a block table is read as blocks
        with self.cache.reading(attention_implementation(self.model)):
            out = self.model(
                input_ids=s.tokens,
                attention_mask=mask,
                position_ids=s.positions,
                use_cache=True,
                **{self._cache_keyword: cache},
                **self._extra,
            )
        self.finish(out.logits[:, -1, :])

    def prepare(self) -> MaskInput:
        """Mark the column each row writes this step valid; render the masks the model reads;
        on a block table, set the columns each row's kernel reads (``lengths``)."""
        column = self.cache.write_pos
        self.masks.attend(column)
        self.cache.set_lengths(self.furthest())
        return self.masks.render(column)

    def furthest(self) -> torch.Tensor:
        """The furthest column each row's mask may open this step (device): its write column,
        since every row moves on in lock-step on this path."""
        return self.cache.write_pos

    def finish(self, logits: torch.Tensor) -> None:
        """Move every row on, then choose and record the next token from ``logits``."""
        self.advance()
        self.commit(logits)

    def leading(self, rows: int) -> DecodeStep:
        """This step over its first ``rows`` rows only (views of the same buffers): what a
        smaller graph of the live-row ladder runs (:mod:`graphcap.rollout.paths.ladder`)."""
        narrowed = copy.copy(self)
        narrowed.state = self.state.leading(rows)
        narrowed.cache = self.cache.leading(rows)
        narrowed.masks = self.masks.leading(rows)
        return narrowed

    def row_tensors(self) -> list[torch.Tensor]:
        """Every per-row buffer of the state and the masks (the cache's rows move their own
        way): what :meth:`move_rows` swaps and :meth:`leading` narrows."""
        return self.state.row_tensors() + self.masks.row_tensors()

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Swap rows ``dst`` (ended) and ``src`` (live) in every per-row buffer, so the live
        rows sit where a smaller batch size reads them; the cache moves its own way
        (:meth:`StaticKVCache.move_rows` copies K/V, the block table swaps table rows). Between
        replays only."""
        index, swapped = torch.cat([dst, src]), torch.cat([src, dst])
        for tensor in self.row_tensors():
            tensor[index] = tensor[swapped]
        self.cache.move_rows(dst, src)

    def with_span(self, span: tuple[int, int]) -> DecodeStep:
        """This step (the same buffers) attending over cache columns ``span`` only."""
        narrowed = copy.copy(self)
        narrowed.span = span
        return narrowed

    def _view(self, mask: MaskInput) -> tuple[MaskInput, Cache]:
        """The mask and cache the model sees: everything, or only the columns of ``span``."""
        if self.span is None or self.masks.form == "padding":
            return mask, self.cache
        lo, hi = self.span
        if isinstance(mask, dict):
            mask = {name: m[..., lo:hi] for name, m in mask.items()}
        else:
            mask = mask[..., lo:hi]
        return mask, SpanView(self.cache, lo, hi)

    def advance(self) -> None:
        """Move every row's write position and position id on by one (in place).

        A separate method so the continuous path can hold finished rows in place instead.
        """
        self.cache.advance(1)
        self.state.positions.add_(1)
