"""RolloutEngine: generate() for Hugging Face decoder models, eagerly or with a captured step.

The engine checks a call's inputs and dispatches it to the static path (eager, static graph,
per-position graphs) or the continuous path; both plan the call (:mod:`~graphcap.rollout.plan`),
prefill, take their buffers from the engine's one
:class:`~graphcap.rollout.holder.GraphHolder` and run a runner
(:mod:`~graphcap.rollout.paths`). docs/architecture.md draws the path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig

from graphcap.backend import Backend
from graphcap.registry import get_backend, register_attention_implementations
from graphcap.rollout.cache import StaticKVCache
from graphcap.rollout.holder import GraphHolder
from graphcap.rollout.holder.agreement import RankAgreement
from graphcap.rollout.holder.compile_cache import CompileCache, resolve_directory
from graphcap.rollout.paths import ROLLOUTS
from graphcap.rollout.plan import Path, check_graph_attention
from graphcap.rollout.plan.fusion import ProjectionFusion
from graphcap.rollout.plan.inputs import Call, check_generator, check_prompts, check_vocab_ids
from graphcap.rollout.plan.scan import scan_model
from graphcap.rollout.plan.signature import attention_implementation
from graphcap.rollout.prefill import without_checkpointing
from graphcap.rollout.results import RolloutResult
from graphcap.rollout.sampling import call_key, generator_kept, keyed_rows
from graphcap.rollout.settings.call import normalise_request
from graphcap.rollout.settings.rollout_config import RolloutConfig
from graphcap.rollout.settings.sampling_params import SamplingParams
from graphcap.rollout.step import DecodeStep

if TYPE_CHECKING:
    from transformers import PreTrainedModel


#: ``recapture_reason`` of the first capturing call after ``sleep``
WOKE = "woke from sleep"
#: vLLM's ``wake_up`` tags
WAKE_TAGS: tuple[str, ...] = ("weights", "kv_cache")


def resolve_backend(backend: Backend | str | None) -> Backend:
    """A Backend object as given, or the one ``graphcap.get_backend`` selects by name / env."""
    if isinstance(backend, Backend):
        return backend
    return get_backend(backend)


class RolloutEngine:
    """Rollouts from ``model`` on ``config.backend``; keeps a captured step across calls.

    One call at a time: concurrent ``generate`` calls on one engine are serialised (they share
    the held buffers and graph); a call from inside a call on the same thread (a forward hook
    that generates) is refused, since it would wait for itself.
    """

    def __init__(self, model: PreTrainedModel, config: RolloutConfig | None = None):
        self.model = model
        self.config = config or RolloutConfig()
        self.backend = resolve_backend(self.config.backend)
        # Attention offered by the backend's plugin becomes a valid attn_implementation name.
        register_attention_implementations(self.backend)
        check_graph_attention(self.config.graph_attention)
        agreement = RankAgreement(self.config.process_group, self.backend.device)
        self._fusion = ProjectionFusion(model) if self.config.wants_fusion(self.backend) else None
        cache = CompileCache(resolve_directory(self.config.compile_cache))
        self._holder = GraphHolder(self.backend, agreement, self._fusion, cache)
        rollout = ROLLOUTS[Path.asked(self.config)]
        self._rollout = rollout(model, self.config, self._holder)
        self._lock = threading.Lock()
        self._caller: int | None = None  # the thread inside a call (see :meth:`_one_call`)
        self._closed = False
        self._sleeping = False  # sleep() freed the buffers and no generate has run since

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        attention_mask: torch.Tensor | None = None,
        sampling: SamplingParams | GenerationConfig | Sequence[SamplingParams] | None = None,
        generator: torch.Generator | None = None,
        *,
        request_max_new_tokens: Sequence[int] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        **overrides: Any,
    ) -> RolloutResult:
        """Generate continuations of left-padded prompts, or of ragged ones (a list of token-id
        lists, padded here); see docs/rollout.md.

        ``request_max_new_tokens`` (continuous path only): each prompt's own token budget.
        ``sampling_params``: vLLM's name for ``sampling``. ``overrides``: SamplingParams fields
        (or vLLM aliases) over ``sampling``, as ``model.generate(max_new_tokens=8)``.
        """
        if sampling_params is not None:
            if sampling is not None:
                raise TypeError("give sampling or sampling_params (vLLM's name), not both")
            sampling = sampling_params
        with self._one_call():
            self._check_open()
            start = time.perf_counter()
            request = normalise_request(self.model, sampling, overrides)
            device = self.backend.device
            scan = scan_model(self.model)
            if self._fusion is not None and self._fusion.join(scan):
                scan = scan_model(self.model)  # the joined parameters' new addresses
            input_ids, attention_mask = check_prompts(
                self.model, scan, device, input_ids, attention_mask, request.call
            )
            check_generator(generator, device)
            check_vocab_ids(self.model, request.call)
            per_prompt = request.per_prompt(input_ids.shape[0])
            if self.config.draws == "per_row" and any(
                p.do_sample and p.seed is None for p in per_prompt
            ):
                per_prompt = keyed_rows(per_prompt, call_key(generator, device))
            call = Call(
                input_ids,
                attention_mask,
                request.call,
                scan,
                per_prompt,
                generator,
                request_max_new_tokens,
            )
            with (
                torch.no_grad(),
                without_checkpointing(self.model),
                generator_kept(self.backend, generator, keep=not call.draws),
                self._fusion.applied() if self._fusion is not None else contextlib.nullcontext(),
            ):
                result = self._rollout.run(call, start)
            woke, self._sleeping = self._sleeping, False
            stats, total_s = result.stats, time.perf_counter() - start
            woken = [WOKE] if woke and stats.captured else []
            result.stats = dataclasses.replace(
                stats,
                captures=self._holder.capture_count(),
                fused_projections=len(self._fusion.active) if self._fusion is not None else 0,
                recapture_reason=woken + stats.recapture_reason,
                attention=stats.attention or attention_implementation(self.model),
                total_s=total_s,
                first_call_s=total_s if stats.captured else None,
            )
            return result

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache, masks, decode buffers and graphs until the next ``generate``.

        For a trainer that needs the memory back while it trains (vLLM's ``sleep``). The
        weights are the caller's and stay untouched at either vLLM ``level`` (1: vLLM offloads
        its weights, 2: discards them; graphcap holds no copy of them to free). The freed
        memory goes back to the device through ``backend.empty_cache()``. The next ``generate``
        allocates and captures again (``stats.captured``, ``capture_s``, ``first_call_s``;
        ``recapture_reason`` starts with ``"woke from sleep"``). Not freed: the weights,
        ``torch.compile``'s compiled code, the backend's capture stream (docs/rollout.md,
        "Memory between rollouts").
        """
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 (vLLM's levels), got {level!r}")
        with self._one_call():
            self._check_open()
            freed = self._holder.drop()
            self._sleeping = self._sleeping or freed

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """End a ``sleep`` explicitly (vLLM's name and signature); safe to call at any time.

        ``generate`` wakes the engine by itself, and the buffers are sized from the call's
        prefill, so this allocates nothing for any of vLLM's ``tags`` (``"weights"``: the
        caller's, never freed; ``"kv_cache"``: allocated by the next call): to pre-warm, run a
        short ``generate``.
        """
        unknown = sorted(set(tags or ()) - set(WAKE_TAGS))
        if isinstance(tags, str) or unknown:
            raise ValueError(f"wake_up tags must be a list of {list(WAKE_TAGS)}, got {tags!r}")
        with self._one_call():
            self._check_open()

    @contextlib.contextmanager
    def _one_call(self) -> Iterator[None]:
        """Hold the engine's lock for one call. A call made from inside one on the same thread
        (a forward hook or a callback that generates) would wait for itself forever: refused."""
        if self._caller == threading.get_ident():
            raise RuntimeError(
                "RolloutEngine called from inside its own generate() on the same thread (a "
                "forward hook or callback that generates?): it would wait for itself. Generate "
                "after the call returns, or with another engine (accelerate_generate's drop-in "
                "hands such a nested call to transformers' generate)"
            )
        with self._lock:
            self._caller = threading.get_ident()
            try:
                yield
            finally:
                self._caller = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this RolloutEngine was shut down; create a new one")

    def shutdown(self) -> None:
        """Release the graphs, their pool and the buffers; the engine cannot be used afterwards."""
        with self._one_call():
            self._holder.drop()
            self._closed = True

    @property
    def captures(self) -> int:
        """Graphs this engine has captured so far (every call, every path)."""
        return self._holder.capture_count()

    @property
    def step(self) -> DecodeStep | None:
        """The decode step held (its cache, masks and state), ``None`` before the first call or
        after a drop; for inspection and tests."""
        return self._holder.held_step()

    @property
    def cache(self) -> StaticKVCache | None:
        """The static KV cache currently held (``None`` before the first call or after drop)."""
        step = self.step
        return None if step is None else step.cache
