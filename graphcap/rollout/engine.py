"""RolloutEngine: generate() for Hugging Face decoder models, eagerly or with a captured step.

Both paths run the same prefill, the same :class:`~graphcap.rollout.step.DecodeStep` and the
same EOS-check cadence, so they consume the random generator identically and produce the same
tokens. The static graph path captures the decode step once per graph signature and replays it;
anything it cannot serve runs eagerly with the reason in the stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, GenerationConfig

from graphcap.backend import Backend
from graphcap.registry import get_backend, register_attention_implementations
from graphcap.rollout.agreement import PEER_RECAPTURE, RankAgreement
from graphcap.rollout.cache import StaticKVCache
from graphcap.rollout.capture import capture_step, fallback_reason
from graphcap.rollout.config import RolloutConfig, SamplingParams, bucket_size
from graphcap.rollout.continuous import ContinuousRunner
from graphcap.rollout.eligibility import check_attention, graph_refusal
from graphcap.rollout.inputs import (
    check_generator,
    check_prompts,
    check_request,
    check_vocab_ids,
    resolve_sampling,
)
from graphcap.rollout.masks import MaskBuffers, layer_windows
from graphcap.rollout.per_position import PositionGraphs, PositionRunner, pinned_refusal
from graphcap.rollout.results import RolloutResult, RolloutStats
from graphcap.rollout.sampling import SamplerSettings
from graphcap.rollout.signature import GraphSignature, model_dtype, signature_of
from graphcap.rollout.step import DecodeState, DecodeStep, accepts_logits_to_keep, cache_keyword

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


@dataclass
class _Resources:
    """Everything allocated for one graph signature (dropped together)."""

    signature: GraphSignature
    cache: StaticKVCache
    masks: MaskBuffers
    state: DecodeState
    step: DecodeStep
    generator: torch.Generator | None
    graph: object | None = None
    positions: PositionGraphs | None = None


def resolve_backend(backend: Backend | str | None) -> Backend:
    """A Backend object as given, or the one ``graphcap.get_backend`` selects by name / env."""
    if isinstance(backend, Backend):
        return backend
    return get_backend(backend)


class RolloutEngine:
    """Rollouts from ``model`` on ``config.backend``; keeps a captured step across calls."""

    def __init__(self, model: PreTrainedModel, config: RolloutConfig | None = None):
        self.model = model
        self.config = config or RolloutConfig()
        self.backend = resolve_backend(self.config.backend)
        # Attention offered by the backend's plugin becomes a valid attn_implementation name.
        register_attention_implementations(self.backend)
        self.captures = 0
        self._graphs_off_reason: str | None = None
        #: the tensor-parallel agreement (no-ops without a process group)
        self.agreement = RankAgreement(self.config.process_group, self.backend.device)
        self._res: _Resources | None = None
        self._continuous: ContinuousRunner | None = None
        self._closed = False
        self._prefill_extra = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}

    # ---- public ---------------------------------------------------------------------------
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        sampling: SamplingParams | GenerationConfig | None = None,
        generator: torch.Generator | None = None,
        *,
        request_max_new_tokens: Sequence[int] | None = None,
    ) -> RolloutResult:
        """Generate continuations of left-padded prompts (see docs/rollout.md).

        ``request_max_new_tokens`` (continuous path only): each prompt's own token budget.
        """
        if self._closed:
            raise RuntimeError("this RolloutEngine was shut down; create a new one")
        start = time.perf_counter()
        params = resolve_sampling(self.model, sampling)
        input_ids, attention_mask = check_prompts(
            self.model, self.backend.device, input_ids, attention_mask, params
        )
        check_generator(generator, self.backend.device)
        check_vocab_ids(self.model, params)
        rows, width = input_ids.shape
        repeats = params.num_return_sequences
        batch, total = rows * repeats, width + params.max_new_tokens
        padded_batch = bucket_size(batch, self.config.batch_buckets)
        padded_total = bucket_size(total, self.config.length_buckets)
        check_request(
            self.model, self.backend, self.config, params, (rows, width), padded_batch, padded_total
        )
        if params.seed is not None:
            if generator is not None:
                generator.manual_seed(params.seed)
            else:
                self.backend.manual_seed(params.seed)
        if self.config.continuous_batch_size is not None:
            if self._continuous is None:
                self._continuous = ContinuousRunner(self)
            return self._continuous.generate(
                input_ids, attention_mask, params, generator, request_max_new_tokens, start
            )
        if request_max_new_tokens is not None:
            raise ValueError(
                "request_max_new_tokens needs the continuous path: set "
                "RolloutConfig(continuous_batch_size=N)"
            )

        stats = RolloutStats(path="eager", batch_size=padded_batch, total_len=padded_total)
        stats.fallback_reason, windows, signature = self._graph_plan(
            params, generator, padded_batch, padded_total
        )
        use_graph = bool(self.config.enable_graph_capture) and stats.fallback_reason is None
        if self._res is not None and self._res.signature != signature:
            stats.recapture_reason = self._res.signature.differences(signature)
            logger.info("graph signature changed (%s); dropping", stats.recapture_reason)
            self._drop()

        with torch.no_grad():
            prefill, logits, next_positions = self._prefill(input_ids, attention_mask)
            # prefill row of each batch row: samples of a prompt, then bucket padding rows
            sources = torch.arange(rows, device=input_ids.device).repeat_interleave(repeats)
            sources = torch.cat([sources, sources[-1:].expand(padded_batch - batch)])
            logits = logits.index_select(0, sources)
            res = self._resources(signature, prefill, logits, params, windows, generator)
            res.cache.reset()
            res.cache.load_prefill(prefill, source_rows=sources)
            res.masks.reset(attention_mask.index_select(0, sources))
            res.state.reset(
                input_ids.index_select(0, sources), next_positions.index_select(0, sources), batch
            )
            res.step.commit(logits)
            stats.prefill_s = time.perf_counter() - start

            runner = res.step
            per_position = None
            if use_graph and params.max_new_tokens > 1 and self.config.per_position_graphs:
                stats.fallback_reason = pinned_refusal(params)
                if stats.fallback_reason is None:
                    steps = params.max_new_tokens - 1
                    runner = per_position = self._position_runner(res, width, steps, stats)
            if self.config.enable_graph_capture and params.max_new_tokens > 1:
                use_graph, per_position = self._agree(res, use_graph, per_position, stats)
                runner = per_position or res.step
            if use_graph and params.max_new_tokens > 1 and per_position is None:
                if res.graph is None:
                    t_capture = time.perf_counter()
                    stats.captured = self._capture(res, prefill, sources)
                    stats.capture_s = time.perf_counter() - t_capture
                    if not stats.captured:
                        stats.fallback_reason = self._graphs_off_reason
                if res.graph is not None:
                    graph = res.graph
                    stats.path = "static_graph"

                    def runner() -> None:
                        self.backend.replay_graph(graph)
                        stats.replays += 1

            t_decode = time.perf_counter()
            stats.steps = self._decode(runner, params.max_new_tokens - 1, res.state)
            self.backend.synchronize()
            stats.decode_s = time.perf_counter() - t_decode
            if per_position is not None:
                self._settle_positions(res, per_position, stats)
            result = self._collect(res.state, batch, width, total, params.return_logprobs, stats)
        stats.captures = self.captures
        stats.total_s = time.perf_counter() - start
        if stats.captured:
            stats.first_call_s = stats.total_s
        return result

    def _agree(
        self,
        res: _Resources,
        use_graph: bool,
        per_position: PositionRunner | None,
        stats: RolloutStats,
    ) -> tuple[bool, PositionRunner | None]:
        """The group's graph decision for this call (unchanged without a process group):
        eager everywhere if a rank cannot use graphs, a fresh capture everywhere if one
        captures. Returns whether to use graphs and the per-position runner to use."""
        if per_position is not None:
            capture = len(per_position.graphs.graphs) < per_position.graphs.steps
        else:
            capture = res.graph is None
        verdict = self.agreement.decide(use_graph, capture)
        if verdict.eager_reason is not None:
            stats.fallback_reason = verdict.eager_reason
            return False, None
        if verdict.recapture:
            stats.recapture_reason.append(PEER_RECAPTURE)
            res.graph = None
            if per_position is not None:
                res.positions = None
                self.backend.empty_cache()
                per_position = self._position_runner(
                    res, per_position.graphs.width, per_position.graphs.steps, stats
                )
        return use_graph, per_position

    def _graph_plan(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        batch_size: int,
        total_len: int,
        refusal: str | None = None,
    ) -> tuple[str | None, dict[str, int | None], GraphSignature]:
        """Why graphs cannot serve this call (``None`` if they can or were not asked for), the
        attention windows, and the signature a graph of this call would have. ``refusal`` is a
        path's own reason to decline (checked after the engine-wide ones)."""
        reason = None
        if self.config.enable_graph_capture:
            check_attention(self.model)
            reason = self._graphs_off_reason or graph_refusal(self.model, self.backend) or refusal
        windows = layer_windows(self.model.config)
        signature = signature_of(
            self.model,
            batch_size=batch_size,
            total_len=total_len,
            device=self.backend.device,
            sampler=SamplerSettings.from_params(params),
            eos_ids=params.eos_ids,
            pad_id=int(params.pad_token_id),
            return_logprobs=params.return_logprobs,
            mask_form=self.backend.capabilities.mask_form,
            windows=windows,
            generator=generator,
        )
        return reason, windows, signature

    def shutdown(self) -> None:
        """Release the graph, its pool and the cache; the engine cannot be used afterwards."""
        self._drop()
        if self._continuous is not None:
            self._continuous.drop()
        self._closed = True

    @property
    def cache(self) -> StaticKVCache | None:
        """The static KV cache currently held (``None`` before the first call or after drop)."""
        return None if self._res is None else self._res.cache

    # ---- steps of a call ------------------------------------------------------------------

    def _prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """Eager forward over the prompts; last-position logits only (as generate positions)."""
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        prefill = DynamicCache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{cache_keyword(self.model): prefill},
            **self._prefill_extra,
        )
        return prefill, out.logits[:, -1, :], position_ids[:, -1] + 1

    def _resources(
        self,
        signature: GraphSignature,
        prefill: DynamicCache,
        logits: torch.Tensor,
        params: SamplingParams,
        windows: dict[str, int | None],
        generator: torch.Generator | None,
    ) -> _Resources:
        """The buffers for this signature: the held ones, or new ones sized from the prefill."""
        specs = StaticKVCache.specs_of(prefill)
        if self._res is not None:
            if self._res.cache.layer_specs() == specs:
                return self._res
            self._drop()
        batch, total = signature.batch_size, signature.total_len
        device = self.backend.device
        cache = StaticKVCache(specs, batch, total)
        masks = MaskBuffers.for_model(
            self.model.config,
            batch,
            total,
            model_dtype(self.model),
            device,
            windows,
            signature.mask_form,
        )
        state = DecodeState.allocate(
            batch, total, logits.shape[-1], params.eos_ids, int(params.pad_token_id), device
        )
        step = DecodeStep(
            self.model,
            cache,
            masks,
            state,
            signature.sampler,
            params.return_logprobs,
            generator,
        )
        self._res = _Resources(signature, cache, masks, state, step, generator)
        return self._res

    def _capture(self, res: _Resources, prefill: DynamicCache, sources: torch.Tensor) -> bool:
        """Capture the decode step, leaving every buffer as it was; False on failure.

        The first replay (by the caller) performs the first decode step, on a device and on the
        CPU reference backend alike (neither runs the work during capture).
        """
        res.graph = self._capture_agreed(res.step, res.generator)
        if res.graph is None:  # finish eagerly from the prefill's cache
            res.cache.reset()
            res.cache.load_prefill(prefill, source_rows=sources)
            return False
        return True

    def _capture_agreed(self, step: DecodeStep, generator: torch.Generator | None) -> object | None:
        """Capture ``step`` and agree on the outcome with the process group: the graph, or
        ``None`` when this rank's or another rank's capture failed (graphs then stay off for this
        engine, with the reason recorded)."""
        try:
            graph = capture_step(self.backend, step, step.mutable_tensors(), generator)
        except Exception as exc:  # any capture failure: rolled back; the call goes on eagerly
            self._graphs_off_reason = fallback_reason(exc)
            self.agreement.peer_capture_failure(captured=False)
            return None
        self.captures += 1
        peer_failure = self.agreement.peer_capture_failure(captured=True)
        if peer_failure is not None:
            self._graphs_off_reason = peer_failure
            return None
        return graph

    def _position_runner(
        self, res: _Resources, width: int, steps: int, stats: RolloutStats
    ) -> PositionRunner:
        """The runner over the held per-position graphs (a new, empty set when none is held or
        the prompt width or step count changed: positions are absolute)."""
        if res.positions is not None:
            changed = res.positions.differences(width, steps)
            if changed:
                stats.recapture_reason += changed
                res.positions = None
                self.backend.empty_cache()
        if res.positions is None:
            res.positions = PositionGraphs(width, steps, self.backend.graph_pool_handle())
        return PositionRunner(self.backend, res.step, res.positions, self.agreement)

    def _settle_positions(
        self, res: _Resources, runner: PositionRunner, stats: RolloutStats
    ) -> None:
        """Record what the per-position runner did; after a failed capture the partial set is
        dropped and the engine stays eager, as after a static capture failure."""
        self.captures += runner.captures
        stats.captured = runner.captures > 0
        stats.capture_s = runner.capture_s
        stats.decode_s -= runner.capture_s
        stats.replays = runner.replays
        if runner.failure is None:
            stats.path = "per_position_graph"
            return
        stats.fallback_reason = self._graphs_off_reason = runner.failure
        res.positions = None
        self.backend.empty_cache()

    def _decode(self, runner: Callable[[], None], max_steps: int, state: DecodeState) -> int:
        """Run up to ``max_steps`` steps; stop early when the device says all rows finished."""
        interval = self.config.eos_check_interval
        for step in range(1, max_steps + 1):
            runner()
            if (
                step % interval == 0
                and step < max_steps
                and self.agreement.all_finished(state.all_finished)
            ):
                return step
        return max_steps

    @staticmethod
    def _collect(
        state: DecodeState,
        batch: int,
        width: int,
        total: int,
        return_logprobs: bool,
        stats: RolloutStats,
    ) -> RolloutResult:
        """The caller's rows and columns (bucket padding cut off), copied out of the buffers."""
        response = state.response[:batch, width:total].to(torch.long)
        finished = state.finished[:batch].tolist()
        return RolloutResult(
            sequences=state.sequences[:batch, :total].clone(),
            response_mask=response,
            response_lengths=response.sum(-1),
            finish_reasons=["eos" if done else "length" for done in finished],
            logprobs=state.logprobs[:batch, width:total].clone() if return_logprobs else None,
            stats=stats,
        )

    def _drop(self) -> None:
        """Release the graph and every buffer of the held signature."""
        res, self._res = self._res, None
        if res is not None:
            res.graph = None
            res.positions = None
            res.cache.release()
            self.backend.empty_cache()
