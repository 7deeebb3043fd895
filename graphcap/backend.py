"""The Backend contract: what a device must provide for graph-captured rollouts.

A backend is one small class. Four graph hooks carry the capture semantics; everything else a
rollout needs (streams, synchronize, RNG state, memory figures) has a default built on
``torch.get_device_module`` and ``torch.accelerator``, overridable where a device differs.
Capability is derived from behaviour (``create_graph()`` returning a graph), never from a name.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal

import torch

from graphcap.errors import GraphcapError, GraphCaptureError, GraphUnsupportedError
from graphcap.exact_ops import ExactOps

MaskForm = Literal["additive", "bool"]
#: Capture error modes of the ``graph`` context managers of torch's CUDA and NPU device modules.
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
#: A backend's fused truncation and draw (:meth:`Backend.truncated_draw`).
TruncatedDraw = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and a sentence saying why (or why not)."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Capabilities:
    """What the rollout engine may rely on; checked by the conformance suite.

    Each field is declared on the :class:`Backend` class under the same name. ``graph_capture``
    is then derived from behaviour (``create_graph()`` returning a graph), and the others are
    reported ``False`` (or ``None``) where they need graph capture and it is missing.
    ``mask_form`` is the attention-mask form its graph-safe attention wants: ``"additive"``
    (float, 0 / -inf, SDPA's float convention) or ``"bool"`` (True = attend).
    ``graph_attention`` names the attention implementation (one the plugin offers through
    ``graphcap_attention_implementations``) that the engine selects by default for captured
    decode steps on this backend; ``None`` keeps the model's own. ``captures_compiled``: work
    inside ``torch.compile``'d (inductor) regions is recorded by a capture, so
    ``RolloutConfig(compile=True)`` may capture a compiled decode forward.
    ``compile_by_default``: compiling the captured step pays on this backend (measured), so
    ``RolloutConfig(compile=None)``, the default, compiles; needs ``captures_compiled``.
    ``fuse_projections_by_default``: fusing q/k/v and gate/up into one product each pays in
    captured steps here (measured), so graph engines with ``RolloutConfig(fuse_projections=None)``,
    the default, fuse them; needs graph capture.
    ``kv_block_size``: the engine keeps K/V in a block table of this block size
    (:mod:`graphcap.kv_blocks`) where ``RolloutConfig.kv_block_size`` is ``"auto"``; ``None``
    keeps the static cache. ``graph_kv_lengths_on_host``: captured block-aware attention takes
    per-row KV lengths as host values frozen into the graph, so the engine hands the lengths of
    every replay to :meth:`Backend.update_graph_kv_lengths` first.
    ``keeps_addresses_on_release``: :meth:`Backend.memory_region` hands out regions whose
    physical memory is given back at ``release()`` and mapped again at ``restore()`` under the
    same addresses, so captured graphs replay after a sleep without a new capture (derived
    from behaviour, like ``graph_capture``).
    """

    graph_capture: bool
    rng_in_graph: bool
    collectives_in_graph: bool
    capture_needs_side_stream: bool
    mask_form: MaskForm
    graph_attention: str | None = None
    captures_compiled: bool = False
    compile_by_default: bool = False
    fuse_projections_by_default: bool = False
    kv_block_size: int | None = None
    graph_kv_lengths_on_host: bool = False
    keeps_addresses_on_release: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Capability names of plugin API version 1, accepted for one more version: old -> new.
OLD_CAPABILITY_NAMES = {
    "captures_graphs": "graph_capture",
    "attention_mask_form": "mask_form",
    "compiles_by_default": "compile_by_default",
    "joins_projections_by_default": "fuse_projections_by_default",
}


def _accept_old_capability_names(cls: type[Backend]) -> None:
    """A class declaring a capability under its version-1 name gets it under the new name,
    with a ``DeprecationWarning``; both names on one class is an error."""
    for old, new in OLD_CAPABILITY_NAMES.items():
        if old not in vars(cls):
            continue
        if new in vars(cls):
            raise TypeError(
                f"{cls.__qualname__} declares both {old} (plugin API 1) and {new}; keep only {new}"
            )
        warnings.warn(
            f"{cls.__qualname__}.{old} is the plugin API 1 name of {new}; declare {new} "
            f"instead (the old name is read for one more version)",
            DeprecationWarning,
            stacklevel=3,
        )
        setattr(cls, new, vars(cls)[old])


class Backend:
    """Base class of every graphcap backend.

    Subclasses set ``name``, ``priority`` and ``device_type``; implement ``availability`` and,
    if the device can capture, the four graph hooks. A backend that cannot capture keeps the
    defaults: ``create_graph()`` returns ``None`` and the other hooks refuse loudly, so nothing
    ever "replays" a graph that recorded nothing.
    """

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    device_type: ClassVar[str] = "cpu"
    # Declared capabilities, one ClassVar per field of :class:`Capabilities`, same name.
    #: Does ``create_graph()`` hand out graphs where this backend is available? The engine goes
    #: by behaviour (``capabilities.graph_capture``); the conformance suite fails a backend
    #: whose behaviour differs from this statement (a capture that regressed to ``None`` must
    #: not pass as "eager only"). ``None`` means undeclared, which the suite also fails.
    graph_capture: ClassVar[bool | None] = None
    rng_in_graph: ClassVar[bool] = False
    collectives_in_graph: ClassVar[bool] = False
    capture_needs_side_stream: ClassVar[bool] = False
    mask_form: ClassVar[MaskForm] = "additive"
    #: Attention implementation the engine selects for captured steps (see Capabilities).
    graph_attention: ClassVar[str | None] = None
    #: Whether a capture records compiled (inductor) regions (see Capabilities).
    captures_compiled: ClassVar[bool] = False
    #: Whether default configurations compile captured steps here (see Capabilities): declare
    #: it only where a benchmark showed the compiled step faster and its cached restart cheap.
    compile_by_default: ClassVar[bool] = False
    #: Whether default graph engines fuse q/k/v and gate/up products here (see Capabilities):
    #: declare it only where a benchmark showed the fused step faster at every batch size.
    fuse_projections_by_default: ClassVar[bool] = False
    #: Block size of the block KV table the engine uses here by default (see Capabilities);
    #: ``None``: the static cache.
    kv_block_size: ClassVar[int | None] = None
    #: Whether captured block-aware attention reads per-row KV lengths as host values frozen
    #: into the graph (see Capabilities and :meth:`update_graph_kv_lengths`).
    graph_kv_lengths_on_host: ClassVar[bool] = False
    #: Distribution that provided the backend; filled in by the registry.
    distribution: str = ""
    distribution_version: str = ""

    def __init__(self, index: int | None = None) -> None:
        self._index = index

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _accept_old_capability_names(cls)

    # ---- identity -------------------------------------------------------------------------
    @classmethod
    def availability(cls) -> Availability:
        """Whether this backend can run on this machine, with the reason. Must not raise."""
        return Availability(True, "always available")

    @classmethod
    def is_available(cls) -> bool:
        return cls.availability().ok

    @property
    def device(self) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        index = self._index if self._index is not None else self.current_device_index()
        return torch.device(self.device_type, index)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} device={self.device}>"

    # ---- graph hooks ----------------------------------------------------------------------
    def create_graph(self) -> Any | None:
        """A new, empty graph object, or ``None`` when this backend cannot capture."""
        return None

    def capture_to_graph(
        self,
        graph: Any,
        pool: Any | None = None,
        stream: Any | None = None,
        capture_error_mode: str | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Context manager: work issued inside is recorded into ``graph``, not run."""
        raise GraphUnsupportedError(self._no_graph_message("capture_to_graph"))

    def replay_graph(self, graph: Any) -> None:
        """Run the recorded work again, on the same memory."""
        raise GraphUnsupportedError(self._no_graph_message("replay_graph"))

    def is_current_stream_capturing(self) -> bool:
        """True only while a capture is in progress on the current stream."""
        return False

    def update_graph_kv_lengths(self, graph: Any, lengths: list[int]) -> None:
        """Set the per-row KV lengths (host ints) the next replay of ``graph`` reads, through
        the device's graph-update API. The engine calls it before every replay of a captured
        block-table step, where ``graph_kv_lengths_on_host`` is declared; ``lengths`` equal
        the device ``BlockView.lengths`` of that replay."""
        raise GraphUnsupportedError(
            f"backend {self.name!r} does not declare graph_kv_lengths_on_host, so it has no "
            "update_graph_kv_lengths; declare both or neither"
        )

    def register_generator(self, graph: Any, generator: torch.Generator) -> None:
        """Make draws from an explicit ``generator`` inside ``graph`` graph-safe, before its
        capture: device graphs advance each generator they know of on every replay (the default
        generator is known to every graph). Default: nothing to register."""

    def one_row_product(self) -> Callable[..., torch.Tensor] | None:
        """A faster ``F.linear(x, weight, bias)`` for batch-1 decode steps (one row of ``x``),
        which captures of ``RolloutConfig(compile=True)`` route every projection through;
        ``None`` (the default): they use ``F.linear``. The callable takes any input and falls
        back to ``F.linear`` itself where its kernel does not apply."""
        return None

    def truncated_draw(self) -> TruncatedDraw | None:
        """A fused kernel for sampled decode steps that truncates each row (top-k, top-p,
        min-p) and draws its keyed token without sorting the vocabulary; ``None`` (the
        default): the core's PyTorch math (:mod:`graphcap.rollout.sampling`), the reference.

        Called as ``draw(scores, temperature, top_k, top_p_floor, min_p, sample, seeded, key,
        finished, generated)`` with float32 ``(B, V)`` scores and the
        :class:`~graphcap.rollout.sampling.RowSettings` columns, it returns ``(tokens, cut)``:
        each row's token (the keyed draw where the row samples with a key, else the first
        maximum of ``scores``, NaN first; any token for finished rows) and its cut, the
        temperature-scaled score at and above which the row keeps its tokens (``-inf`` keeps
        all, NaN marks a sampled row whose scores held a NaN). It keeps the set ``generate``
        keeps (ties at top-p's cut aside) and draws what the reference draws from the same
        key; the conformance suite checks both."""
        return None

    def exact_ops(self) -> ExactOps | None:
        """The operations a trainer-exact forward runs on this device
        (:class:`~graphcap.exact_ops.ExactOps`: a product, an attention and the row reductions
        whose order follows neither the number of rows nor the padding), or ``None`` (the
        default): the backend offers none, and ``RolloutConfig(trainer_exact=True)`` and
        :func:`graphcap.rollout.trainer_exact` refuse it with that reason."""
        return None

    def compile_options(self) -> dict[str, Any]:
        """Inductor options for the regions captures of ``RolloutConfig(compile=True)`` compile
        (``torch.compile(..., options=...)``), for code generation this device needs or gains
        from. Default: none."""
        return {}

    def compiled_capture_context(self) -> contextlib.AbstractContextManager[None]:
        """Settings the warm-up and capture of a ``RolloutConfig(compile=True)`` step run under,
        such as which library's kernels its products use: a graph replays the kernels its
        capture recorded, so the choice reaches that step's replays and nothing else (eager
        steps, the prefill, training). Only compiled captures, whose rounding already differs
        from eager steps', take it: a plain capture stays bit-equal to eager steps. Default:
        nothing changes."""
        return contextlib.nullcontext()

    def graph_pool_handle(self) -> Any | None:
        """A memory-pool handle several graphs can share, or ``None`` if pools are not shared."""
        return None

    def memory_region(self) -> MemoryRegion | None:
        """A new :class:`MemoryRegion` (memory given back at a sleep and mapped again at the
        same addresses), or ``None`` (the default) where the device cannot keep addresses
        across a release: engines then free their buffers and graphs at a sleep and capture
        again after it."""
        return None

    def _no_graph_message(self, hook: str) -> str:
        return (
            f"backend {self.name!r} cannot capture graphs (create_graph() returned None), so "
            f"{hook}() has nothing to do; check backend.capabilities.graph_capture and run "
            "eagerly"
        )

    # ---- capabilities ---------------------------------------------------------------------
    def _creates_graphs(self) -> bool:
        """Behaviour, probed once: does ``create_graph()`` hand out a graph object?"""
        cached = self.__dict__.get("_created_graph")
        if cached is None:
            cached = self.create_graph() is not None
            self.__dict__["_created_graph"] = cached
        return cached

    def _releases_in_place(self) -> bool:
        """Behaviour, probed once: does ``memory_region()`` hand out a region?"""
        cached = self.__dict__.get("_region_probe")
        if cached is None:
            region = self.memory_region()
            cached = self.__dict__["_region_probe"] = region is not None
            if region is not None:
                region.close()
        return cached

    @property
    def supports_graph_capture(self) -> bool:
        """Deprecated: read ``capabilities.graph_capture``."""
        warnings.warn(
            "Backend.supports_graph_capture is deprecated; read backend.capabilities.graph_capture",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._creates_graphs()

    @property
    def capabilities(self) -> Capabilities:
        """The declared capabilities, with ``graph_capture`` from behaviour and the ones that
        need graph capture switched off where it is missing."""
        capture = self._creates_graphs()
        return Capabilities(
            graph_capture=capture,
            rng_in_graph=capture and self.rng_in_graph,
            collectives_in_graph=capture and self.collectives_in_graph,
            capture_needs_side_stream=self.capture_needs_side_stream,
            mask_form=self.mask_form,
            graph_attention=self.graph_attention if capture else None,
            captures_compiled=capture and self.captures_compiled,
            compile_by_default=capture and self.captures_compiled and self.compile_by_default,
            fuse_projections_by_default=capture and self.fuse_projections_by_default,
            kv_block_size=self.kv_block_size,
            graph_kv_lengths_on_host=capture and self.graph_kv_lengths_on_host,
            keeps_addresses_on_release=self._releases_in_place(),
        )

    # ---- device plumbing (defaults on torch.get_device_module / torch.accelerator) --------
    @property
    def device_module(self) -> Any:
        return torch.get_device_module(self.device_type)

    def current_device_index(self) -> int:
        return int(self.device_module.current_device())

    def device_name(self) -> str:
        """The name the device reports (e.g. "NVIDIA H200"), or the device type."""
        try:
            return str(self.device_module.get_device_name(self.device))
        except Exception:  # the CPU, or a device module without it: the name is only a label
            return self.device.type

    def synchronize(self) -> None:
        self.device_module.synchronize()

    def current_stream(self) -> Any:
        return self.device_module.current_stream()

    def new_stream(self) -> Any:
        return self.device_module.Stream()

    def capture_stream(self) -> Any:
        """The side stream this backend object captures (and warms up) on, made once.

        A new stream per capture would leave per-stream library state behind on every recapture
        (cuBLAS keeps a workspace for each stream it has run on: 32 MiB on Hopper, never freed).
        """
        stream = self.__dict__.get("_capture_stream")
        if stream is None:
            stream = self.__dict__["_capture_stream"] = self.new_stream()
        return stream

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self.device_module.stream(stream)

    def manual_seed(self, seed: int) -> None:
        """Seed this device's default generator (and the CPU one, which prompts may use)."""
        torch.manual_seed(seed)
        if self.device_type != "cpu":
            self.device_module.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        if self.device_type == "cpu":
            return torch.get_rng_state()
        return self.device_module.get_rng_state(self.device)

    def set_rng_state(self, state: torch.Tensor) -> None:
        if self.device_type == "cpu":
            torch.set_rng_state(state)
        else:
            self.device_module.set_rng_state(state, self.device)

    def memory_allocated(self) -> int | None:
        """Bytes allocated on the device by torch, or ``None`` where the device does not say."""
        if self.device_type == "cpu":
            return None
        return int(torch.accelerator.memory_allocated(self.device))

    def max_memory_allocated(self) -> int | None:
        if self.device_type == "cpu":
            return None
        return int(torch.accelerator.max_memory_allocated(self.device))

    def reset_peak_memory_stats(self) -> None:
        if self.device_type != "cpu":
            torch.accelerator.reset_peak_memory_stats(self.device)

    def memory_available(self) -> int | None:
        """Bytes a new allocation could still get: the device's free memory plus what torch's
        caching allocator holds unused; on the host, its physical memory. ``None`` where the
        device does not say. The rollout engine refuses a request above it before allocating."""
        if self.device_type == "cpu":
            try:
                return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (AttributeError, ValueError, OSError):
                return None
        module = self.device_module
        try:
            free, _total = module.mem_get_info(self.device)
            unused = module.memory_reserved(self.device) - module.memory_allocated(self.device)
        except (AttributeError, RuntimeError, TypeError):
            return None
        return int(free + unused)

    def free_memory(self) -> int | None:
        """Bytes the device itself reports free (not torch's allocator counters): what a sleep
        gives back shows here. On the host, the kernel's available memory (Linux
        ``MemAvailable``); ``None`` where the device does not say."""
        if self.device_type == "cpu":
            return _host_available_memory()
        try:
            free, _total = self.device_module.mem_get_info(self.device)
        except (AttributeError, RuntimeError, TypeError):
            return None
        return int(free)

    def empty_cache(self) -> None:
        if self.device_type != "cpu":
            torch.accelerator.empty_cache()

    def communication_backend_name(self) -> str:
        """The ``torch.distributed`` backend for collectives on this device."""
        import torch.distributed as dist

        if not dist.is_available():
            return "gloo"
        default = dist.Backend.default_device_backend_map.get(self.device_type)
        return default or "gloo"

    def describe(self) -> dict[str, Any]:
        """A plain dict for ``graphcap info`` and the conformance report."""
        availability = self.availability()
        info: dict[str, Any] = {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.distribution_version,
            "priority": self.priority,
            "declares_graphs": self.graph_capture,
            "available": availability.ok,
            "reason": availability.reason,
        }
        if availability.ok:
            info["device"] = str(self.device)
            info["capabilities"] = self.capabilities.as_dict()
        return info


class MemoryRegion:
    """Device memory a backend can give back and map again under the same addresses.

    Tensors allocated inside :meth:`allocating` (and graphs captured into :meth:`graph_pool`)
    live in the region. :meth:`release` returns its physical memory to the device while every
    address stays reserved; :meth:`restore` maps memory there again. Contents allocated with
    ``keep=True`` survive the pair (the backend saves them to host memory); the rest read as
    undefined after a restore, as memory that was never written. Replays while released are an
    error: the device has nothing there. One region per engine; :meth:`close` frees it for good.
    """

    def allocating(self, keep: bool) -> contextlib.AbstractContextManager[None]:
        """Within the block, new tensors live in this region; ``keep``: their contents survive
        a release."""
        raise NotImplementedError

    def capturing(self, keep: bool = False) -> contextlib.AbstractContextManager[None]:
        """The context a capture runs in, so what it allocates lives in this region; ``keep``:
        its contents survive a release too (a graph's own memory needs that only where a replay
        reads what an earlier one left there). Default: :meth:`allocating`."""
        return self.allocating(keep=keep)

    def graph_pool(self) -> Any | None:
        """The pool handle captures pass to ``capture_to_graph`` with :meth:`capturing`;
        ``None``: the backend's own pool handle."""
        return None

    @property
    def released(self) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        """Give the physical memory back; addresses stay reserved."""
        raise NotImplementedError

    def restore(self) -> None:
        """Map memory at the same addresses again (``keep`` contents restored)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes the region holds while mapped."""
        raise NotImplementedError

    def close(self) -> None:
        """Free everything for good (tensors still referenced elsewhere stay valid where the
        device allows, but leave the region)."""


def _host_available_memory() -> int | None:
    """Linux's ``MemAvailable``: what the host could still hand out without swapping."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class GraphBackend(Backend):
    """A backend that captures through a *graph library*: torch's device-graph API.

    Every capturing backend wrote the same graph hooks; they live here once. The library is an
    object with the graph class (named by :attr:`graph_class`), ``graph(graph, pool=, stream=,
    capture_error_mode=)``, ``is_current_stream_capturing()``, ``graph_pool_handle()``,
    ``current_stream()`` and ``set_stream()``: by default the device module (the CUDA and NPU
    ones have this form); the CPU reference graphs offer the same form. A subclass sets
    ``graph_class`` and ``capture_hint`` and overrides :meth:`graph_library` only when its device
    module is not where the graphs are.
    """

    graph_capture: ClassVar[bool | None] = True
    #: The graph class's name in the graph library, e.g. ``"CUDAGraph"``.
    graph_class: ClassVar[str] = "Graph"
    #: Appended to a failed capture's error: the usual causes on this device.
    capture_hint: ClassVar[str] = ""
    #: Further keyword arguments of the library's ``graph(...)`` this device's captures need.
    graph_options: ClassVar[dict[str, Any]] = {}

    def graph_library(self) -> Any:
        """The object holding the graph API; the device module unless overridden."""
        return self.device_module

    def create_graph(self) -> Any:
        return getattr(self.graph_library(), self.graph_class)()

    def capture_to_graph(
        self,
        graph: Any,
        pool: Any | None = None,
        stream: Any | None = None,
        capture_error_mode: str | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """The graph library's ``graph(...)`` made safe to fail: arguments by keyword (the NPU
        module orders them differently from the CUDA one after ``stream``), the error mode
        (default "global") checked now, not at ``__enter__``."""
        mode = capture_error_mode or "global"
        if mode not in CAPTURE_ERROR_MODES:
            raise ValueError(
                f"capture_error_mode must be one of {', '.join(CAPTURE_ERROR_MODES)} "
                f"(or None for 'global'), not {capture_error_mode!r}"
            )
        return _guarded_capture(
            self.graph_library(), graph, pool, stream, mode, self.capture_hint, self.graph_options
        )

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    def is_current_stream_capturing(self) -> bool:
        return bool(self.graph_library().is_current_stream_capturing())

    def graph_pool_handle(self) -> Any | None:
        return self.graph_library().graph_pool_handle()


@contextlib.contextmanager
def _guarded_capture(
    device_module: Any,
    graph: Any,
    pool: Any | None,
    stream: Any | None,
    mode: str,
    hint: str,
    options: dict[str, Any],
) -> Iterator[None]:
    """When a capture fails, torch raises from ``capture_end`` before leaving its capture
    stream: the caller's stream is restored so an eager fallback does not run on the side
    stream, and the error becomes a :class:`GraphCaptureError` carrying ``hint``."""
    previous = device_module.current_stream()
    try:
        with device_module.graph(
            graph, pool=pool, stream=stream, capture_error_mode=mode, **options
        ):
            yield
    except GraphcapError:
        raise  # already says what went wrong
    except RuntimeError as exc:
        raise GraphCaptureError(f"graph capture failed: {exc}\n{hint}") from exc
    finally:
        device_module.set_stream(previous)
