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
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig

from graphcap.backend import Backend
from graphcap.errors import HeldMemoryWarning, WouldRunEagerlyError
from graphcap.registry import get_backend, register_attention_implementations
from graphcap.rollout.cache import StaticKVCache
from graphcap.rollout.exact import check_exact_model, exact_ops_of, trainer_exact
from graphcap.rollout.holder import GraphHolder
from graphcap.rollout.holder.agreement import RankAgreement
from graphcap.rollout.holder.compile_cache import CompileCache, resolve_directory
from graphcap.rollout.holder.weights import Served
from graphcap.rollout.paths import ROLLOUTS
from graphcap.rollout.plan import DecodePath, check_graph_attention, eager_reason
from graphcap.rollout.plan.fusion import ProjectionFusion
from graphcap.rollout.plan.inputs import Call, check_generator, check_prompts, check_vocab_ids
from graphcap.rollout.plan.scan import ModelScan, scan_model
from graphcap.rollout.plan.signature import attention_implementation
from graphcap.rollout.prefill import without_checkpointing
from graphcap.rollout.results import RolloutResult, SleepReport
from graphcap.rollout.sampling import call_key, generator_kept, keyed_rows
from graphcap.rollout.settings.call import CallSettings, normalise_request
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
        if self.config.trainer_exact:
            check_exact_model(model, "RolloutConfig(trainer_exact=True)")
            exact_ops_of(self.backend)  # refuses a backend that offers none
        agreement = RankAgreement(self.config.process_group, self.backend.device)
        self._fusion = ProjectionFusion(model) if self.config.wants_fusion(self.backend) else None
        cache = CompileCache(resolve_directory(self.config.compile_cache))
        self._holder = GraphHolder(
            self.backend,
            agreement,
            self._fusion,
            cache,
            keep_across_sleep=self.config.sleep_keeps_graphs,
            weights=self.config.weights,
        )
        rollout = ROLLOUTS[DecodePath.asked(self.config, self.backend)]
        self._rollout = rollout(model, self.config, self._holder)
        self._lock = threading.Lock()
        self._caller: int | None = None  # the thread inside a call (see :meth:`_one_call`)
        self._closed = False
        #: sleep() dropped the buffers and graphs (no memory region) and no generate has run
        self._dropped = False
        #: what the latest ``sleep`` that held something gave back
        self.last_sleep: SleepReport | None = None
        self._warned_held = False

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        attention_mask: torch.Tensor | None = None,
        sampling: SamplingParams | GenerationConfig | Sequence[SamplingParams] | None = None,
        generator: torch.Generator | None = None,
        *,
        request_max_new_tokens: Sequence[int] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        require_graph: bool = False,
        **overrides: Any,
    ) -> RolloutResult:
        """Generate continuations of left-padded prompts, or of ragged ones (a list of token-id
        lists, padded here); see docs/rollout.md.

        ``request_max_new_tokens`` (continuous path only): each prompt's own token budget.
        ``sampling_params``: vLLM's name for ``sampling``. ``require_graph``: raise
        :class:`~graphcap.errors.WouldRunEagerlyError` with the plan's reason, before anything
        runs, where the call's steps would run eagerly (the drop-in hands such calls to
        ``generate``; a capture that fails during the call still finishes it eagerly).
        ``overrides``: SamplingParams fields (or vLLM aliases) over ``sampling``, as
        ``model.generate(max_new_tokens=8)``.
        """
        if sampling_params is not None:
            if sampling is not None:
                raise TypeError("give sampling or sampling_params (vLLM's name), not both")
            sampling = sampling_params
        with self._one_call(), contextlib.ExitStack() as stack:
            self._check_open()
            start = time.perf_counter()
            request = normalise_request(self.model, sampling, overrides)
            scan = scan_model(self.model)
            if require_graph:
                self._require_graph(request.call, scan)
            wake_s = self._holder.wake()
            device = self.backend.device
            if self._fusion is not None and self._fusion.join(scan):
                scan = scan_model(self.model)  # the joined parameters' new addresses
            weights = stack.enter_context(self._serving(scan))
            if weights is not None and weights.copied:
                scan = scan_model(self.model)  # the held tensors' addresses (FSDP2: unsharded)
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
            if self.config.trainer_exact:  # the prefill, every step and the capture alike
                stack.enter_context(trainer_exact(self.model, self.backend))
            with (
                torch.no_grad(),
                without_checkpointing(self.model),
                generator_kept(self.backend, generator, keep=not call.draws),
                self._fusion.applied() if self._fusion is not None else contextlib.nullcontext(),
            ):
                result = self._rollout.run(call, start)
            dropped, self._dropped = self._dropped, False
            stats, total_s = result.stats, time.perf_counter() - start
            woken = [WOKE] if dropped and stats.captured else []
            result.stats = dataclasses.replace(
                stats,
                captures=self._holder.capture_count(),
                fused_projections=len(self._fusion.active) if self._fusion is not None else 0,
                recapture_reason=woken + stats.recapture_reason,
                attention=stats.attention or attention_implementation(self.model),
                total_s=total_s,
                first_call_s=total_s if stats.captured else None,
                wake_s=wake_s,
                weights=weights.kind if weights is not None else "model",
                weights_copied=weights.copied if weights is not None else 0,
            )
            return result

    def _require_graph(self, settings: CallSettings, scan: ModelScan) -> None:
        """Raise where the plan would run this call's steps eagerly (``require_graph``)."""
        disabled = self._holder.disabled_reason
        reason = eager_reason(self.model, self.backend, self.config, settings, disabled, scan)
        if reason is not None:
            raise WouldRunEagerlyError(reason)

    def _serving(self, scan: ModelScan) -> contextlib.AbstractContextManager[Served | None]:
        """The tensors a graph engine's graphs read, bound to the model for the call
        (:mod:`graphcap.rollout.holder.weights`; FSDP2 unsharded for the call); nothing for
        eager engines (FSDP2 then gathers each layer in its forward, as under ``generate``)."""
        if not self.config.wants_graphs(self.backend):
            return contextlib.nullcontext()
        return self._holder.weights.serving(self.model, scan.sharded)

    def sleep(self, level: int = 1) -> None:
        """Give the engine's device memory back until the next ``generate`` (vLLM's ``sleep``),
        for a trainer that needs it while it trains.

        Where the backend keeps addresses across a release
        (``Capabilities.keeps_addresses_on_release``; ``RolloutConfig.sleep_keeps_graphs``),
        the K/V cache, the decode buffers and the graphs' memory are released in place: the
        physical memory returns to the device, and the next call maps it again (``wake_s``)
        and replays the graphs already captured. Elsewhere they are freed, and the next call
        allocates and captures again (``recapture_reason`` starts with ``"woke from sleep"``).
        The weights are the caller's and stay untouched at either vLLM ``level`` (1: vLLM
        offloads its weights, 2: discards them). Not freed: ``torch.compile``'s compiled code
        and the backend's capture stream (docs/rollout.md, "Memory between rollouts").
        """
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 (vLLM's levels), got {level!r}")
        with self._one_call():
            self._check_open()
            report = self._holder.sleep()
            if report is not None:
                self.last_sleep = report
                self._dropped = self._dropped or not report.kept_graphs
                self._warn_held(report.still_held_bytes)

    def _warn_held(self, still_held: int) -> None:
        """Say once per engine that a sleep keeps the storage of moved weights (the graphs
        read it), and how to have it given back instead."""
        if not still_held or self._warned_held:
            return
        self._warned_held = True
        warnings.warn(
            HeldMemoryWarning(
                f"sleep() keeps {still_held / 2**20:.1f} MiB: the storage the model's weights "
                "had when the graphs were captured, which the trainer has since moved (the "
                "graphs read it, and each call copies the new values there). For a trainer "
                "that gives its weights new storage every round, RolloutConfig(weights='copy') "
                "keeps the engine's own copy in its memory region, given back at each sleep "
                "(docs/trainers.md, 'Weights that move')"
            ),
            stacklevel=3,
        )

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """End a ``sleep`` explicitly (vLLM's name and signature); safe to call at any time.

        Maps the released memory again where the sleep kept it (what ``generate`` does by
        itself otherwise), so a trainer can take the mapping's cost outside its timed round.
        After a sleep that freed the buffers nothing is allocated here: they are sized from
        the next call's prefill. vLLM's ``tags``: ``"weights"`` (the caller's, never freed) and
        ``"kv_cache"``.
        """
        unknown = sorted(set(tags or ()) - set(WAKE_TAGS))
        if isinstance(tags, str) or unknown:
            raise ValueError(f"wake_up tags must be a list of {list(WAKE_TAGS)}, got {tags!r}")
        with self._one_call():
            self._check_open()
            if tags is None or "kv_cache" in tags:
                self._holder.wake()

    @property
    def sleeping(self) -> bool:
        """Whether the engine's memory is released (a ``sleep`` that kept the graphs, no
        ``generate`` or ``wake_up`` since)."""
        return self._holder.asleep

    def memory_held(self) -> int:
        """Bytes of device memory the engine holds in its memory region while awake (K/V,
        buffers, the graphs' memory): what a sleep gives back; 0 where the backend has no
        region or nothing is held."""
        return self._holder.region_bytes()

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
            self._holder.weights.clear()
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
