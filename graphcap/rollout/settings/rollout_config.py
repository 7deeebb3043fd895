"""RolloutConfig: the engine's own settings, fixed for its lifetime (per-call ones are
:class:`~graphcap.rollout.settings.sampling_params.SamplingParams`)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch.distributed as dist

from graphcap.rollout.settings.field_types import check_field_types

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PreTrainedModel

    from graphcap.backend import Backend

#: ``stats.fallback_reason`` of every call of an engine with ``enable_graph_capture=False``
GRAPHS_OFF = "graphs are off in the config (RolloutConfig(enable_graph_capture=False))"
#: The continuous path's eager-only layouts (they move cache columns between steps)
EAGER_LAYOUTS: tuple[str, ...] = ("align_decode_fronts", "trim_cache")

#: The largest ``RolloutConfig.kv_block_size``: a larger block only wastes memory per row.
MAX_KV_BLOCK_SIZE = 4096


@dataclass
class RolloutConfig:
    """Engine-wide settings.

    ``enable_graph_capture``: ``None`` (the default) captures the decode step where the backend
    can (``Capabilities.graph_capture``) and the call allows (else the call runs eagerly with
    the reason in ``stats.fallback_reason``; with an eager-only layout, ``align_decode_fronts``
    or ``trim_cache``, every call does); ``True`` asks for graphs (an attention implementation
    graphs cannot serve is then an error); ``False`` runs every call on the eager loop
    (``fallback_reason``: :data:`GRAPHS_OFF`).
    ``enable_cuda_graph`` is the deprecated name of ``enable_graph_capture``: its value moves to
    the new field with a ``DeprecationWarning``; both set to different values is an error.
    ``backend`` is a :class:`graphcap.Backend`, a backend name, or ``None`` for
    ``graphcap.get_backend()`` (which honours ``GRAPHCAP_BACKEND``).
    ``batch_buckets`` / ``length_buckets`` pad the batch (rows x samples) and the total length
    (prompt width + max_new_tokens) up to the smallest listed size that fits, so varying
    requests reuse a few graphs; a request larger than every bucket runs at its own size.
    ``length_buckets="auto"`` (the default) pads graph engines' total lengths to powers of two
    (:meth:`total_length`), on the continuous path too. ``continuous_batch_size=N`` runs the
    batch's rows as a request queue through ``N`` slots
    (docs/continuous.md); ``align_decode_fronts`` / ``trim_cache`` are eager-only layouts of
    that path (they move cache rows and columns, which a captured graph cannot allow).
    ``per_position_graphs=True`` captures one graph per decode position for calls with pinned
    lengths (``min_new_tokens == max_new_tokens``); other calls use the static graph path, with
    the reason in the stats (docs/rollout.md, "Per-position graphs").
    ``process_group``: the tensor-parallel group this rank decodes with; the graph decision and
    the periodic "finished" checks are then all-reduced over it so ranks never diverge in
    collectives (docs/rollout.md, "Tensor parallelism"). ``None``: no communication.
    ``graph_attention``: the attention implementation captured decode steps run. ``"auto"``
    takes the backend's graph-safe attention (``Capabilities.graph_attention``) where it offers
    one, else the model's own; ``None`` always keeps the model's own; a name selects that
    registered implementation. Eager calls and the prefill always use the model's own.
    ``max_request_bytes``: refuse a call whose estimated allocation exceeds it (calls above the
    memory the backend reports available are refused in any case).
    ``compile``: ``None`` (the default) compiles captured steps where the backend declares that
    it pays (``Capabilities.compile_by_default``: CUDA), ``False`` never, ``True`` always
    (refused with the reason where the backend cannot capture compiled code). Per-position
    graphs never compile; tensor-parallel steps (``process_group``) compile only when asked.
    ``compile_cache``: where compiled code is kept between processes
    (:mod:`graphcap.rollout.holder.compile_cache`): ``"auto"`` is ``$GRAPHCAP_COMPILE_CACHE`` or
    ``~/.cache/graphcap/compile``, a path (a string or ``os.PathLike``) that directory,
    ``None`` none beyond torch's own caches. Compiled captures run the blocks around attention
    (each decoder layer with its attention left out, the rotary function and embedding, the
    K/V cache writes) through ``torch.compile``, traced once per block class
    (:func:`graphcap.rollout.plan.regions.compiled_regions`); the compilation happens in the
    warm-up before the first capture, so it is part of that call's ``warmup_s``,
    ``capture_s`` and ``first_call_s`` (``stats.compiled`` says so). The captured projections
    compute through the backend's one-row product where it offers one
    (``Backend.one_row_product``: batch-1 steps), and every region compiles with the backend's
    inductor options (``Backend.compile_options``). Compiled code rounds
    differently: steps equal eager ones within float rounding, not bit for bit. Needs a backend
    that declares ``captures_compiled``; elsewhere calls run eagerly with the reason.
    ``kv_block_size``: where decode steps keep K/V. ``"auto"`` (the default) follows the
    backend (``Capabilities.kv_block_size``: a block table of that block size, or the static
    cache), ``None`` always the static cache, an int a block table of that many columns per
    block (docs/continuous.md, "The block table"). Eager layouts that move cache columns
    (``align_decode_fronts``, ``trim_cache``) and per-position graphs keep the static cache
    (``stats.kv_layout`` says which ran).
    ``fuse_projections``: projections that read one input (q/k/v, gate/up) run as one product
    over their weights fused in one buffer, whose views the parameters become
    (:mod:`graphcap.rollout.plan.fusion`; ``stats.fused_projections`` counts the groups), in
    every step and the prefill of a call, eager or captured; results equal the unfused
    model's within float rounding. ``None`` (the default) fuses in graph engines where the
    backend declares that it pays (``Capabilities.fuse_projections_by_default``: CUDA),
    ``True`` always, ``False`` never.
    ``batch_ladder``: the batch sizes a call shrinks to as rows end, so a step computes only
    rows still generating (the continuous path's slots once its queue is empty):
    ``"auto"`` (the default) every power of two below the call's batch and three quarters of
    each, a tuple those sizes, ``None`` never (docs/rollout.md, "The live-row ladder"). Each
    size is one more graph, captured when a call first reaches it and kept. Not with
    ``draws="generate"`` (moving rows would change how many numbers a step draws),
    per-position graphs, ``process_group`` or the continuous path's eager layout modes.
    ``draws``: how sampled rows draw. ``"per_row"`` (the default): each row from its own
    counter-based stream (its ``seed``, or one number drawn from the shared generator per call
    plus its prompt index), so a row's tokens do not depend on the rest of the batch and a
    step reads the scores once; ``"generate"``: unseeded rows draw ``multinomial`` from the
    shared generator over all rows, generate's own random numbers (docs/rollout.md, "Random
    numbers").
    ``sleep_keeps_graphs``: ``True`` (the default) keeps what the engine holds in a memory
    region of the backend where it offers one (``Capabilities.keeps_addresses_on_release``),
    so ``sleep()`` gives the memory back and the graphs replay after it without a new capture;
    ``False`` frees the buffers and graphs at a sleep and captures again after it (docs/rollout.md,
    "Memory between rollouts").
    ``weights``: what captured graphs read. ``"model"``: the model's own parameters and
    buffers (in-place updates reach them for free); one that gets new storage is kept by the
    engine at the captured address and the new values copied there each call (no capture).
    ``"copy"``: the engine's own copy in its memory region (released at a sleep), refilled
    from the model at each call, for trainers whose weights move every round. ``"auto"`` (the
    default): ``"copy"`` for DeepSpeed ZeRO-3 parameters and FSDP2 models, else ``"model"``
    (docs/trainers.md, "Weights that move"). FSDP2 models are served from the copy in every
    mode: FSDP frees and reallocates its unsharded storage in place (docs/trainers.md,
    "Sharded trainers").
    ``trainer_exact``: every call (prefill, decode step, eager or captured, and ``generate``
    calls the drop-in hands on) runs the forward of :func:`graphcap.rollout.trainer_exact`, so
    each recorded log-prob equals, bit for bit, the one a trainer computes under that context
    (docs/trainers.md, "Trainer-exact rollouts"). Llama, Mistral and Qwen2/3 models only;
    ``compile`` and ``fuse_projections`` stay off (they round differently), ``graph_attention``
    is the exact attention. On backends that offer trainer-exact operations
    (``Backend.exact_ops()``: the CPU reference, CUDA with Triton); others are refused.
    """

    enable_graph_capture: bool | None = None
    eos_check_interval: int = 16
    backend: Backend | str | None = None
    batch_buckets: tuple[int, ...] | None = None
    length_buckets: tuple[int, ...] | Literal["auto"] | None = "auto"
    continuous_batch_size: int | None = None
    align_decode_fronts: bool = False
    trim_cache: bool = False
    per_position_graphs: bool = False
    process_group: ProcessGroup | None = None
    graph_attention: str | None = "auto"
    compile: bool | None = None
    compile_cache: str | None = "auto"
    fuse_projections: bool | None = None
    enable_cuda_graph: bool | None = field(default=None, repr=False)
    max_request_bytes: int | None = None
    kv_block_size: int | Literal["auto"] | None = "auto"
    draws: Literal["per_row", "generate"] = "per_row"
    batch_ladder: tuple[int, ...] | Literal["auto"] | None = "auto"
    sleep_keeps_graphs: bool = True
    weights: Literal["auto", "model", "copy"] = "auto"
    trainer_exact: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.compile_cache, os.PathLike):  # a pathlib.Path names a directory too
            self.compile_cache = os.fspath(self.compile_cache)
        check_field_types(self)
        self._check_kv_block_size()
        _check_backend(self.backend)
        if self.enable_cuda_graph is not None:
            warnings.warn(
                "RolloutConfig.enable_cuda_graph is deprecated; use enable_graph_capture "
                "(graphs are captured on any backend that can, not only CUDA)",
                DeprecationWarning,
                stacklevel=3,
            )
            if (
                self.enable_graph_capture is not None
                and self.enable_graph_capture != self.enable_cuda_graph
            ):
                raise ValueError(
                    f"enable_cuda_graph={self.enable_cuda_graph} conflicts with "
                    f"enable_graph_capture={self.enable_graph_capture}; set only "
                    "enable_graph_capture"
                )
            self.enable_graph_capture = bool(self.enable_cuda_graph)
            self.enable_cuda_graph = None
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.eos_check_interval < 1:
            raise ValueError(f"eos_check_interval must be >= 1, got {self.eos_check_interval}")
        self.batch_buckets = _buckets("batch_buckets", self.batch_buckets)
        if self.batch_ladder not in (None, "auto"):
            self.batch_ladder = _buckets("batch_ladder", self.batch_ladder)
        if self.length_buckets != "auto":
            self.length_buckets = _buckets("length_buckets", self.length_buckets)
        self._check_continuous()
        self._check_per_position()
        if self.compile is True and self._graphs_off():
            raise ValueError(
                "compile=True compiles the captured decode step: leave enable_graph_capture at "
                "None or True (eager calls always run the model as it is)"
            )
        if self.compile is True and self.per_position_graphs:
            raise ValueError(
                "compile=True with per_position_graphs=True would compile the forward once per "
                "decode position (each attends over a different width); set only one"
            )
        self._check_trainer_exact()
        if self.compile_cache == "":
            raise ValueError(
                'compile_cache="" names no directory; use "auto", a directory, or None for '
                "torch's own caches only"
            )
        if self.process_group is not None:
            check_process_group(self.process_group)

    def wants_graphs(self, backend: Backend) -> bool:
        """Whether calls on ``backend`` are planned on a graph path (each call's plan may still
        refuse it, with the reason): ``enable_graph_capture`` where set, else where the
        backend can capture and no eager-only layout is set."""
        if self.enable_graph_capture is None:
            return self.eager_layout is None and backend.capabilities.graph_capture
        return self.enable_graph_capture

    @property
    def eager_layout(self) -> str | None:
        """The eager-only layout of the continuous path that is set (``align_decode_fronts``,
        ``trim_cache``: they move cache columns a graph would read), or ``None``."""
        return next((n for n in EAGER_LAYOUTS if getattr(self, n)), None)

    def _graphs_off(self) -> bool:
        """Whether no backend could give this config graphs."""
        explicit = self.enable_graph_capture
        return explicit is False or (explicit is None and self.eager_layout is not None)

    def total_length(self, model: PreTrainedModel, total: int, backend: Backend) -> int:
        """The total length (prompt width + new tokens) a call's buffers get: ``total`` padded
        to ``length_buckets``. ``"auto"`` pads graph engines' calls (on ``backend``) to the next
        power of two from 64 up to the model's ``max_position_embeddings``, so calls whose
        prompts come padded to another width reuse one graph (eager engines keep ``total``)."""
        if self.length_buckets != "auto":
            return bucket_size(total, self.length_buckets)
        if not self.wants_graphs(backend):
            return total
        limit = getattr(model.config, "max_position_embeddings", None) or 2**16
        padded = max(64, 1 << (total - 1).bit_length())
        return padded if padded <= limit else total

    def wants_compile(self, backend: Backend) -> bool:
        """Whether captured steps compile on ``backend``: ``compile`` where set, else the
        backend's declared default, except for per-position graphs (never) and tensor-parallel
        steps (``process_group`` set: compiled TP steps have not run anywhere yet, so they
        compile only when asked)."""
        if self.per_position_graphs or self.trainer_exact:
            return False
        if self.compile is None:
            return self.process_group is None and backend.capabilities.compile_by_default
        return self.compile

    def wants_fusion(self, backend: Backend) -> bool:
        """Whether calls fuse q/k/v and gate/up products on ``backend``: ``fuse_projections``
        where set, else in graph engines where the backend declares that fusing pays (eager
        engines run the model as it is unless asked)."""
        if self.trainer_exact:
            return False
        if self.fuse_projections is None:
            return self.wants_graphs(backend) and backend.capabilities.fuse_projections_by_default
        return self.fuse_projections

    def _check_trainer_exact(self) -> None:
        """Refuse what would round differently from the trainer's forward in exact mode."""
        if not self.trainer_exact:
            return
        asked = [
            name
            for name, value in (
                ("compile", self.compile),
                ("fuse_projections", self.fuse_projections),
            )
            if value
        ]
        if asked:
            raise ValueError(
                f"trainer_exact=True with {' and '.join(f'{n}=True' for n in asked)}: compiled "
                "blocks and joined projections round differently from the trainer's forward; "
                "leave them unset (they stay off in exact mode)"
            )
        if self.graph_attention not in ("auto", None):
            raise ValueError(
                f"trainer_exact=True runs its own attention; graph_attention="
                f"{self.graph_attention!r} would replace it: leave graph_attention unset"
            )

    def _check_kv_block_size(self) -> None:
        value = self.kv_block_size
        if value is None or value == "auto":
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"RolloutConfig.kv_block_size must be a positive int (columns per block), "
                f'"auto" (the backend\'s block size) or None (the static cache), got {value!r}'
            )
        if value > MAX_KV_BLOCK_SIZE:
            raise ValueError(
                f"RolloutConfig.kv_block_size {value} is over {MAX_KV_BLOCK_SIZE} columns: every "
                f"row holds at least one block, so a block that large only wastes memory; use "
                f"16-512 (or None for the static cache)"
            )

    def _check_per_position(self) -> None:
        if not self.per_position_graphs:
            return
        if self._graphs_off():
            raise ValueError(
                "per_position_graphs=True captures graphs: leave enable_graph_capture at None "
                "or True"
            )
        if self.continuous_batch_size is not None:
            raise ValueError(
                "per_position_graphs needs every row to run the same positions, but "
                "continuous_batch_size refills slots at different positions; set only one"
            )

    def _check_continuous(self) -> None:
        if self.continuous_batch_size is not None and self.continuous_batch_size < 1:
            raise ValueError(
                f"continuous_batch_size must be >= 1, got {self.continuous_batch_size}"
            )
        explicit_lengths = self.length_buckets not in (None, "auto")
        if self.continuous_batch_size is not None and (self.batch_buckets or explicit_lengths):
            raise ValueError(
                "batch_buckets / length_buckets do not apply to the continuous path (its slot "
                "count already fixes the batch shape); drop them or continuous_batch_size"
            )
        for name in EAGER_LAYOUTS:
            if not getattr(self, name):
                continue
            if self.continuous_batch_size is None:
                raise ValueError(f"{name} is a continuous-path mode: set continuous_batch_size")
            if self.enable_graph_capture is True:
                raise ValueError(
                    f"{name}=True moves cache rows/columns between steps, but a captured graph "
                    f"replays on fixed addresses; drop {name} or set enable_graph_capture=False "
                    "(the eager continuous loop supports it)"
                )


def check_process_group(group: object) -> None:
    """Refuse anything but a ``torch.distributed`` process group of an initialised job."""
    if not dist.is_available():
        raise ValueError(
            "process_group is set but this torch build has no torch.distributed; leave "
            "process_group=None"
        )
    if not dist.is_initialized():
        raise ValueError(
            "process_group is set but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(...) before building the RolloutConfig"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed.ProcessGroup (e.g. "
            f"torch.distributed.new_group(...) or the default group), got {type(group).__name__}"
        )


def _check_backend(backend: object) -> None:
    from graphcap.backend import Backend

    if backend is not None and not isinstance(backend, (Backend, str)):
        raise TypeError(
            f"RolloutConfig.backend must be a graphcap.Backend, a backend name (str) or None, "
            f"got {type(backend).__name__}"
        )


def _buckets(name: str, sizes: tuple[int, ...] | None) -> tuple[int, ...] | None:
    if sizes is None:
        return None
    values = tuple(sorted(set(sizes)))
    if not values or values[0] < 1:
        raise ValueError(f"{name} must be a non-empty list of positive sizes, got {sizes!r}")
    return values


def bucket_size(value: int, buckets: tuple[int, ...] | None) -> int:
    """The smallest bucket >= ``value``; ``value`` itself when no bucket fits or none is set."""
    return next((b for b in buckets or () if b >= value), value)
