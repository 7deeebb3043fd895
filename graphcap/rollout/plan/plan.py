"""The plan of one call: which path serves it, the graph signature, and why not a graph.

Every refusal lives here, in one pure function of the model, the backend, the settings and the
request (docs/architecture.md, "One request, one path"); :func:`eager_reason` is the one answer to
"why do this call's steps run eagerly", which the engine gives the drop-in before a call runs
(``RolloutEngine.generate(require_graph=True)``). Two kinds: what graphs cannot serve sends the
call to the eager loop with the reason recorded in the stats (graphs off in the config, a backend
without graphs or without a declared capability the call needs, a stateful model, parameters
gathered inside forward (ZeRO-3, FSDP; tensor-parallel shards are resident and keep graphs),
chunked attention, autocast's weight cache, an attention implementation that reads host values
per call, nothing to decode); what the user explicitly asked for that graphs cannot do raises
:class:`~graphcap.errors.GraphUnsupportedModelError` (that attention implementation under
``enable_graph_capture=True``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.distributed as dist

from graphcap.backend import Backend, TruncatedDraw
from graphcap.errors import GraphUnsupportedModelError
from graphcap.rollout.cache.blocks import rounded_length
from graphcap.rollout.cache.masks import layer_windows, unsupported_layer_types
from graphcap.rollout.exact import EXACT_ATTENTION
from graphcap.rollout.plan.regions import regions_to_compile
from graphcap.rollout.plan.scan import ModelScan
from graphcap.rollout.plan.signature import (
    GraphSignature,
    attention_implementation,
    autocast_state,
    signature_of,
)
from graphcap.rollout.sampling import SamplerShape
from graphcap.rollout.settings.call import CallSettings
from graphcap.rollout.settings.rollout_config import GRAPHS_OFF, RolloutConfig

#: Attention implementations whose kernels read host values per call (varlen lengths, block
#: tables) or build masks with host logic; a graph would freeze them.
UNSAFE_ATTENTION_MARKERS: tuple[str, ...] = ("flash_attention", "flex_attention", "paged")


class DecodePath(StrEnum):
    """The path a call's decode steps take. The values are what ``RolloutStats.path`` reports
    (a ``DecodePath`` is its string: ``DecodePath.EAGER == "eager"``)."""

    EAGER = "eager"
    STATIC_GRAPH = "static_graph"
    PER_POSITION_GRAPH = "per_position_graph"
    CONTINUOUS_EAGER = "continuous_eager"
    CONTINUOUS_GRAPH = "continuous_graph"

    @property
    def is_graph(self) -> bool:
        return self in _GRAPH_PATHS

    @property
    def continuous(self) -> bool:
        return self in (DecodePath.CONTINUOUS_EAGER, DecodePath.CONTINUOUS_GRAPH)

    @property
    def eager_fallback(self) -> DecodePath:
        """The eager path this one runs as when graphs cannot serve it (itself if eager)."""
        return DecodePath.CONTINUOUS_EAGER if self.continuous else DecodePath.EAGER

    @property
    def per_position(self) -> bool:
        """A graph per decode position, captured while decoding (a host-given column span)."""
        return self is DecodePath.PER_POSITION_GRAPH

    @classmethod
    def asked(cls, config: RolloutConfig, backend: Backend) -> DecodePath:
        """The path ``config`` asks for on ``backend``, before any refusal."""
        graph = config.wants_graphs(backend)
        if config.continuous_batch_size is not None:
            return cls.CONTINUOUS_GRAPH if graph else cls.CONTINUOUS_EAGER
        if not graph:
            return cls.EAGER
        return cls.PER_POSITION_GRAPH if config.per_position_graphs else cls.STATIC_GRAPH


_GRAPH_PATHS = frozenset(
    {DecodePath.STATIC_GRAPH, DecodePath.PER_POSITION_GRAPH, DecodePath.CONTINUOUS_GRAPH}
)


def attention_refusal(model: torch.nn.Module) -> str | None:
    """Why the model's attention implementation cannot be captured (it is known not to be
    graph-safe), or ``None``."""
    name = attention_implementation(model)
    if any(marker in name for marker in UNSAFE_ATTENTION_MARKERS):
        return (
            f"attention implementation {name!r} is not graph-safe (it reads host values per "
            "call); load the model with attn_implementation='sdpa' or 'eager'"
        )
    return None


def check_attention(model: torch.nn.Module) -> None:
    """Raise if the model's attention implementation is known not to be graph-safe (graphs were
    asked for explicitly)."""
    reason = attention_refusal(model)
    if reason is not None:
        raise GraphUnsupportedModelError(
            f"{reason}, or set RolloutConfig(enable_graph_capture=False)"
        )


def check_sharded_group(scan: ModelScan, config: RolloutConfig) -> None:
    """Raise if the model is sharded over ranks that ``config.process_group`` does not cover.

    A tensor-parallel forward runs collectives over the parameters' device mesh; a rank that
    stopped decoding (or replayed while another captured) without agreeing first would leave
    the others waiting in a collective forever.
    """
    mesh = scan.mesh
    if mesh is None or mesh.size() == 1:
        return
    ranks = set(mesh.mesh.flatten().tolist())
    if config.process_group is None:
        raise ValueError(
            f"the model's parameters are sharded over {len(ranks)} ranks (DTensor parameters) "
            "but RolloutConfig.process_group is None: pass the tensor-parallel group, e.g. "
            "RolloutConfig(process_group=torch.distributed.group.WORLD) under torchrun, so "
            "that every rank takes the same path and steps"
        )
    covered = set(dist.get_process_group_ranks(config.process_group))
    if not ranks <= covered:
        raise ValueError(
            f"RolloutConfig.process_group (ranks {sorted(covered)}) does not contain every rank "
            f"the model is sharded over ({sorted(ranks)}); pass a group that does"
        )


def graph_refusal(model: torch.nn.Module, backend: Backend, scan: ModelScan) -> str | None:
    """Why this call must run eagerly although graphs were requested, or ``None``."""
    if not backend.capabilities.graph_capture:
        return f"backend {backend.name!r} cannot capture graphs (create_graph() returned None)"
    # private: transformers' own flag for models with recurrent state (no public equivalent)
    if getattr(model, "_is_stateful", False):
        return f"{type(model).__name__} is stateful (_is_stateful); its state is not in the cache"
    if scan.non_resident:
        return scan.non_resident
    unsupported = unsupported_layer_types(getattr(model, "config", None))
    if unsupported:
        return (
            f"layer types {unsupported} need masks beyond full/sliding-window attention; only "
            "full_attention and sliding_attention layers are supported on the graph path"
        )
    enabled, _, cache_enabled = autocast_state(backend.device.type)
    if enabled and cache_enabled:
        return (
            "autocast with its weight cache enabled would freeze cast copies of the weights in "
            "the graph; use torch.autocast(..., cache_enabled=False)"
        )
    return None


def capability_refusal(
    backend: Backend, settings: CallSettings, config: RolloutConfig
) -> str | None:
    """Why the backend's declared capabilities rule graphs out for this call, or ``None``."""
    caps = backend.capabilities
    if settings.any_sampled and not caps.rng_in_graph:
        return (
            f"backend {backend.name!r} declares rng_in_graph=False (every replay would draw the "
            "same numbers): sampled calls run eagerly"
        )
    if config.process_group is not None and not caps.collectives_in_graph:
        return (
            f"backend {backend.name!r} declares collectives_in_graph=False: tensor-parallel "
            "steps (process_group set) run eagerly"
        )
    if config.compile is True and not caps.captures_compiled:
        return (
            f"backend {backend.name!r} declares captures_compiled=False (a capture cannot record "
            "torch.compile'd regions): calls with RolloutConfig(compile=True) run eagerly"
        )
    return None


def compile_refusal(scan: ModelScan) -> str | None:
    """Why this call's step is captured uncompiled although compiling was asked or declared,
    or ``None``. A model with live forward hooks: its compiled captures differed from eager
    from the first step while its uncompiled capture matched (docs/decisions.md, decision 33)."""
    hooked = scan.host_state.hooked_module()
    if hooked is None:
        return None
    return (
        f"forward hooks ({hooked}): compiled captures of hooked models are not token-exact "
        "against eager (docs/decisions.md, decision 33), so the step is captured uncompiled; "
        "remove the hook before the rollout to get the compiled step"
    )


def eager_reason(
    model: torch.nn.Module,
    backend: Backend,
    config: RolloutConfig,
    settings: CallSettings,
    disabled_reason: str | None,
    scan: ModelScan,
) -> str | None:
    """Why this call's steps run eagerly, or ``None`` where a graph path serves them: the
    config (graphs off, an eager-only layout), the engine (a failed capture earlier,
    ``disabled_reason``), the backend, the model, the call. Raises where graphs were asked for
    explicitly (``enable_graph_capture=True``) and the model's attention cannot be captured."""
    if config.enable_graph_capture is False:
        return GRAPHS_OFF
    if config.enable_graph_capture is None and config.eager_layout is not None:
        return (
            f"{config.eager_layout}=True moves cache columns between steps, which a graph "
            "cannot: the continuous path runs eagerly"
        )
    if config.enable_graph_capture:
        check_attention(model)
    return (
        disabled_reason
        or graph_refusal(model, backend, scan)
        or attention_refusal(model)
        or capability_refusal(backend, settings, config)
        or request_refusal(settings)
    )


def request_refusal(settings: CallSettings) -> str | None:
    """Why this request has nothing a graph path can serve, or ``None``."""
    if settings.max_new_tokens == 1:
        return "max_new_tokens=1: the prefill chooses the only token, there is no step to replay"
    return None


def pinned_refusal(settings: CallSettings) -> str | None:
    """Why this call cannot use per-position graphs (lengths not pinned), or ``None``."""
    if settings.min_new_tokens == settings.max_new_tokens:
        return None
    return (
        "per_position_graphs needs pinned lengths (min_new_tokens == max_new_tokens, got "
        f"{settings.min_new_tokens} and {settings.max_new_tokens}): EOS could end rows early, so "
        "the positions are not known in advance; this call used the static graph path"
    )


def check_graph_attention(name: str | None) -> None:
    """Refuse a ``graph_attention`` name transformers does not know, before any call: found
    only at capture, it would turn graphs off for the engine."""
    # loaded here, not at import: it costs seconds, and the model's own module has loaded it
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if name not in (None, "auto", *known):
        raise ValueError(
            f"RolloutConfig.graph_attention={name!r} is not a registered attention "
            f"implementation (registered: {', '.join(known)}); use 'auto' for the backend's, "
            "None for the model's own, or register the function with "
            "transformers.AttentionInterface.register before creating the engine"
        )


def selected_attention(model: torch.nn.Module, backend: Backend, config: RolloutConfig) -> str:
    """The attention implementation captured steps run: the config's choice, else the
    backend's graph-safe one ("auto"), else the model's own."""
    if config.trainer_exact:  # the prefill's and the trainer's attention too
        return EXACT_ATTENTION
    choice = config.graph_attention
    if choice == "auto":
        choice = backend.capabilities.graph_attention
    return choice or attention_implementation(model)


def kv_layout(config: RolloutConfig, backend: Backend, path: DecodePath) -> int | None:
    """The block size of the call's block KV table, or ``None`` for the static cache.

    ``RolloutConfig.kv_block_size`` ``"auto"`` follows the backend's declaration. The eager
    layouts that move cache columns (``align_decode_fronts``, ``trim_cache``) and per-position
    graphs (which attend over a host-given column span) keep the static cache: both read
    contiguous columns of a row, which the table does not keep.
    """
    size = config.kv_block_size
    if size == "auto":
        size = backend.capabilities.kv_block_size
    if config.align_decode_fronts or config.trim_cache or path.per_position:
        return None
    return size


@dataclass(frozen=True)
class Plan:
    """How one call runs.

    ``path``: the path graphs take (:class:`DecodePath`: static, per-position or continuous
    graphs) or the eager one (eager, continuous eager). ``reason``: why the
    call does not take the path the config asked for (eager instead of a graph, or the static
    graph instead of per-position graphs, or uncompiled steps); ``None`` when it does.
    ``compiled``: captured steps run the blocks around attention compiled
    (:mod:`graphcap.rollout.plan.regions`). ``sampler``: the sampler shape the call's steps
    run (the signature holds its per-engine part; the holder keeps a graph per shape).
    ``draw``: the backend's fused truncation and draw, ``None`` for the core's math.
    """

    path: DecodePath
    reason: str | None
    signature: GraphSignature
    windows: dict[str, int | None]
    attention: str
    compiled: bool
    sampler: SamplerShape
    draw: TruncatedDraw | None

    @property
    def graph(self) -> bool:
        return self.path.is_graph


def plan_call(
    model: torch.nn.Module,
    backend: Backend,
    config: RolloutConfig,
    settings: CallSettings,
    generator: torch.Generator | None,
    *,
    batch_size: int,
    total_len: int,
    prompt_width: int,
    sampler: SamplerShape,
    disabled_reason: str | None,
    scan: ModelScan,
) -> Plan:
    """The plan of one call (pure: reads the model and settings, changes nothing).

    ``scan``: the call's one pass over the model (:func:`~graphcap.rollout.plan.scan.scan_model`).
    ``sampler``: the sampler shape the call's steps run (:meth:`GraphHolder.sampler_for`);
    ``disabled_reason``: why graphs are off for this engine (a failed capture earlier).
    """
    asked = DecodePath.asked(config, backend)
    path = asked.eager_fallback
    attention = attention_implementation(model)
    compiled = False
    check_sharded_group(scan, config)
    reason = eager_reason(model, backend, config, settings, disabled_reason, scan)
    if reason is None:
        attention = selected_attention(model, backend, config)
        compiled = config.wants_compile(backend) and bool(regions_to_compile(model))
        if config.compile is True and not compiled:
            reason = (
                "compile=True found no decoder block to compile (no module holding an "
                "attention with a layer_idx): the step is captured uncompiled"
            )
        if compiled and (reason := compile_refusal(scan)) is not None:
            compiled = False
        path = asked
        if path.per_position:
            reason = pinned_refusal(settings)
            path = DecodePath.STATIC_GRAPH if reason else path
    windows = layer_windows(model.config)
    block_size = kv_layout(config, backend, path)
    signature = signature_of(
        scan,
        batch_size=batch_size,
        total_len=total_len if block_size is None else rounded_length(total_len, block_size),
        device=backend.device,
        sampler=sampler.per_engine,
        pad_id=settings.pad_token_id,
        mask_form=backend.capabilities.mask_form,
        windows=windows,
        generator=generator,
        attention=attention,
        prompt_width=prompt_width if path.per_position else None,
        decode_steps=settings.max_new_tokens - 1 if path.per_position else None,
        compiled=compiled,
        kv_block_size=block_size,
    )
    draw = backend.truncated_draw()
    return Plan(path, reason, signature, windows, attention, compiled, sampler, draw)
