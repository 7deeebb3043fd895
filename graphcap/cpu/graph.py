"""A CPU graph with device-graph semantics: record the aten operations of a capture, replay them.

A silent no-op graph hides every graph bug (a host counter frozen by capture, a forgotten replay,
an ``.item()`` inside the step). This graph behaves like a CUDA graph instead, so those bugs show up
in CPU tests:

* capture records every aten operation (a ``TorchDispatchMode``) and runs it so shapes flow, then
  restores memory that existed before capture, poisons memory allocated during capture (it holds no
  computed values on a device until the first replay) and restores the RNG state;
* replay re-issues exactly the recorded operations on the same tensor objects, with every host
  value (Python numbers, shapes, lists) frozen as it was at capture, and never runs Python code;
* host synchronisations (``.item()``, ``bool()``, and the reads that bypass the dispatcher:
  ``.tolist()``, ``.numpy()``, ``__array__``), ``torch.tensor(...)`` literals and compiled regions
  are refused at capture with a :class:`~graphcap.errors.GraphCaptureError` naming the operation.

What this needs from torch beyond its public API comes from :mod:`graphcap.cpu.torch_internals`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from graphcap.cpu.torch_internals import (
    C10D_MODULE,
    COLLECTIVE_HELPERS,
    COLLECTIVE_NAMESPACES,
    DATA_DEPENDENT_OUTPUT,
    DYNAMIC_OUTPUT_SHAPE,
    FUNCTIONAL_COLLECTIVES,
    INDEX_PUT_IMPL,
    INPLACE_VIEW,
    OpOverload,
    TorchDispatchMode,
    refuse_compiled_regions,
    schema_arguments,
    storage_key,
)
from graphcap.errors import GraphcapError, GraphCaptureError

__all__ = ["CPUGraph", "ReferenceGraphs", "is_capturing"]

_tls = threading.local()

# Python-level constructors that copy host data into a new tensor: on a device this is a pageable
# host-to-device copy, which a graph cannot hold (and a CUDA capture rejects).
_LITERAL_CONSTRUCTORS = frozenset(
    {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}
)
# Tensor methods that copy tensor data to the host without an aten operation (the dispatcher, and
# so the recorder, never sees them): on a device they are a synchronising device-to-host copy,
# which a capture rejects; here the value read would be frozen into the graph unnoticed.
_HOST_READS = {
    torch.Tensor.tolist: "Tensor.tolist()",
    torch.Tensor.numpy: "Tensor.numpy()",
    torch.Tensor.__array__: "Tensor.__array__() (numpy.asarray / np.array of a tensor)",
    torch.Tensor.__repr__: "Tensor.__repr__() (printing or formatting a tensor)",
}
_LIFT_COPY = torch.ops.aten.lift_fresh_copy.default
_SET = torch.ops.aten.set_
_RESIZES = (torch.ops.aten.resize_, torch.ops.aten.resize_as_)
_INDEX = torch.ops.aten.index.Tensor
_INDEX_PUTS = frozenset(
    {
        torch.ops.aten.index_put.default,
        torch.ops.aten.index_put_.default,
        INDEX_PUT_IMPL,
    }
)
_REPEAT_INTERLEAVE = torch.ops.aten.repeat_interleave.Tensor
_MASK_DTYPES = (torch.bool, torch.uint8)
if dist.is_available():
    #: Functional collectives a capture records (without communicating) and a replay issues; the
    #: output of each is described by :func:`_unissued`.
    _COLLECTIVES = frozenset(
        {
            FUNCTIONAL_COLLECTIVES.all_reduce,
            FUNCTIONAL_COLLECTIVES.all_reduce_,
            FUNCTIONAL_COLLECTIVES.broadcast,
            FUNCTIONAL_COLLECTIVES.broadcast_,
            FUNCTIONAL_COLLECTIVES.all_gather_into_tensor,
            FUNCTIONAL_COLLECTIVES.reduce_scatter_tensor,
        }
    )
else:  # torch built without distributed: no collective exists
    _COLLECTIVES = frozenset()
_REDUCE_OP_NAMES = (
    {
        dist.ReduceOp.SUM: "sum",
        dist.ReduceOp.AVG: "avg",
        dist.ReduceOp.PRODUCT: "product",
        dist.ReduceOp.MIN: "min",
        dist.ReduceOp.MAX: "max",
    }
    if dist.is_available()
    else {}
)
# Byte written over integer memory allocated during capture: 0xA5A5... is a recognisably wrong
# value for every integer width (and an out-of-range index, so gathers on it fail loudly).
_POISON_BYTE = 0xA5
#: Storages a memory region has released, by :func:`storage_key`, each with a weak reference
#: to the storage (a key whose storage died may name new memory): a replay touching one raises,
#: as a device graph would read unmapped memory (:mod:`graphcap.cpu.region`).
RELEASED_STORAGES: dict[int, weakref.ref[torch.UntypedStorage]] = {}


def _released(storages: frozenset[int]) -> bool:
    """Whether any of ``storages`` is released now (dead entries are dropped on the way)."""
    for key in RELEASED_STORAGES.keys() & storages:
        if RELEASED_STORAGES[key]() is not None:
            return True
        del RELEASED_STORAGES[key]
    return False


def poison_storage(storage: torch.UntypedStorage, dtype: torch.dtype) -> None:
    """Fill ``storage`` with values no computation produced: NaN for floating types, True for
    booleans, 0xA5 bytes for integers (out of range as an index, so gathers fail loudly)."""
    numel = storage.nbytes() // dtype.itemsize
    view = torch.empty(0, dtype=dtype).set_(storage, 0, (numel,))
    if dtype.is_floating_point or dtype.is_complex:
        view.fill_(float("nan"))
    elif dtype == torch.bool:
        view.fill_(True)
    else:
        storage.fill_(_POISON_BYTE)


def is_capturing() -> bool:
    """True only while a :meth:`CPUGraph.capture` is in progress on the calling thread."""
    return getattr(_tls, "graph", None) is not None


def _has_mask_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices or ())


def _host_sync_reason(func: OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why ``func`` needs the host to see device data, or ``None`` if it can live in a graph.

    The rule follows torch's own operator tags: ``data_dependent_output`` ops return a host value
    computed from tensor data (``item``, ``_local_scalar_dense``, ``equal``, ``allclose``);
    ``dynamic_output_shape`` ops size their output from tensor data (``nonzero``,
    ``masked_select``, ``unique``, ``bincount``...). Two tagged ops are data-dependent only for
    some arguments: integer indexing and ``repeat_interleave`` with ``output_size`` are fine.
    Boolean-mask ``index_put`` (a hidden ``nonzero``) is a host sync the tags do not mark.
    ``bool(t)``, ``int(t)``, ``float(t)`` and ``is_nonzero`` reach the dispatcher as
    ``_local_scalar_dense``.
    """
    tags = func.tags
    if DATA_DEPENDENT_OUTPUT in tags:
        return "reads a tensor value on the host (.item(), bool(), int(), float(), equal, ...)"
    if func in _INDEX_PUTS:
        if _has_mask_index(args[1] if len(args) > 1 else kwargs.get("indices")):
            return "boolean-mask assignment runs nonzero, whose size depends on the data"
        return None
    if DYNAMIC_OUTPUT_SHAPE in tags:
        if func is _INDEX and not _has_mask_index(args[1] if len(args) > 1 else kwargs["indices"]):
            return None
        if func is _REPEAT_INTERLEAVE and _arg(func, args, kwargs, "output_size", None) is not None:
            return None
        return "its output shape depends on tensor values, which the host cannot know in a graph"
    return None


def _arg(func: OpOverload, args: tuple, kwargs: dict, name: str, default: Any) -> Any:
    for position, argument in enumerate(schema_arguments(func)):
        if argument.name == name:
            if name in kwargs:
                return kwargs[name]
            return args[position] if position < len(args) else default
    return default


def _same_size_resize(func: OpOverload, args: tuple) -> bool:
    """Whether a resize_ / resize_as_ leaves the tensor's size as it is (a harmless no-op)."""
    target = args[1].shape if func.overloadpacket is torch.ops.aten.resize_as_ else args[1]
    return tuple(args[0].shape) == tuple(target)


def _overrides_dispatch(cls: type) -> bool:
    """Whether tensors of type ``cls`` handle dispatch themselves (wrapper subclasses)."""
    return cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _completing(func: OpOverload) -> Callable[..., Any]:
    """``func`` (a functional collective) followed by a wait for its completion.

    A device graph orders a collective on its stream like any kernel. Eagerly the caller waits
    on the output it holds (``wait_tensor``), which a replay does not run for the fresh output
    it copies from: so the replay waits here, before anything reads the result.
    """
    op = func.op

    def run(*args: Any, **kwargs: Any) -> Any:
        result = op(*args, **kwargs)
        return FUNCTIONAL_COLLECTIVES.wait_tensor(result)

    return run


def _unissued(func: OpOverload, args: tuple, kwargs: dict) -> torch.Tensor:
    """The output of a collective, allocated but not computed: capture issues no collective.

    On a device, capture records kernels without running them, so a rank never waits for its
    peers inside a capture; one rank failing its capture cannot leave another stuck in a
    collective. The values do not matter: memory allocated during capture is poisoned and
    written memory restored when the capture ends.
    """
    tensor = args[0] if args else kwargs["input"]
    packet = func.overloadpacket
    if packet in (FUNCTIONAL_COLLECTIVES.all_reduce_, FUNCTIONAL_COLLECTIVES.broadcast_):
        return tensor
    rows = tensor.shape[0] if tensor.dim() else 1
    if packet is FUNCTIONAL_COLLECTIVES.all_gather_into_tensor:
        rows *= _arg(func, args, kwargs, "group_size", 1)
    elif packet is FUNCTIONAL_COLLECTIVES.reduce_scatter_tensor:
        rows //= _arg(func, args, kwargs, "group_size", 1)
    if not tensor.dim():
        return torch.empty_like(tensor)
    return tensor.new_empty((rows, *tensor.shape[1:]))


class _OpInfo:
    """What the schema of one operator says, computed once per operator."""

    __slots__ = ("generator_pos", "metadata_only", "written")

    def __init__(self, func: OpOverload) -> None:
        arguments = schema_arguments(func)
        # In-place view ops (t_, unsqueeze_, as_strided_...) change only a tensor's sizes and
        # strides, host-side state a device graph never sees: they run once, at capture.
        self.metadata_only = INPLACE_VIEW in func.tags
        # (position, name) of every argument the operator writes to (in-place and out= ops).
        self.written = [
            (i, a.name)
            for i, a in enumerate(arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        self.generator_pos = next(
            (i for i, a in enumerate(arguments) if a.name == "generator"), None
        )

    def get(self, position: int, name: str, args: tuple, kwargs: dict) -> Any:
        if name in kwargs:
            return kwargs[name]
        return args[position] if position < len(args) else None


_OP_INFO: dict[OpOverload, _OpInfo] = {}


def _op_info(func: OpOverload) -> _OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        info = _OP_INFO[func] = _OpInfo(func)
    return info


def _leaves(value: Any) -> list[Any]:
    """The leaves of an aten operation's arguments or result, in a fixed order.

    Schemas nest values only in tuples (results, ``torch.return_types``) and lists
    (``Tensor[]``, ``Tensor?[]``), and keyword arguments come as a dict: those are all there
    is to flatten.
    """
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _leaves(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    return [value]


def tensors_in(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in _leaves(value) if isinstance(leaf, torch.Tensor)]


# A replay step: the operator's C++ entry point (``OpOverload.op``, what ``OpOverload.__call__``
# forwards to, one Python frame less per op), its frozen arguments, then where fresh results go:
# the recorded output of a single-tensor op, or (index into the flattened result, recorded output)
# pairs for the others; both ``None`` when the op only writes its arguments.
_Step = tuple[
    Callable[..., Any],
    tuple,
    dict,
    "torch.Tensor | None",
    "tuple[tuple[int, torch.Tensor], ...] | None",
]


class _Recording:
    """Everything one capture accumulates; discarded or frozen into a replay plan at the end."""

    def __init__(self) -> None:
        self.steps: list[_Step] = []
        self.op_names: list[str] = []
        # Every tensor any operation saw or produced, kept alive for the graph's lifetime: object
        # ids and storages would otherwise be reused by later allocations.
        self.keepalive: list[Any] = []
        self.new_storages: dict[int, tuple[torch.UntypedStorage, torch.dtype]] = {}
        self.snapshots: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self.error: GraphCaptureError | None = None
        #: frozen aliases of the tensors operations were given (see :meth:`frozen`)
        self.aliases: dict[tuple, torch.Tensor] = {}

    def frozen(self, value: Any) -> Any:
        """``value`` with every tensor replaced by an alias of the memory it had at this point
        of the capture (the same storage, offset, sizes and strides): a device graph replays on
        addresses, so a replay must not follow a tensor object that later points elsewhere
        (``param.data = ...``, an in-place resize of its metadata)."""
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or _overrides_dispatch(type(value)):
                return value
            key = (id(value), value.data_ptr(), value.storage_offset(), *value.shape, None,
                   *value.stride())  # fmt: skip
            alias = self.aliases.get(key)
            if alias is None:
                alias = self.aliases[key] = value.detach()
            return alias
        if isinstance(value, (tuple, list)):
            return type(value)(self.frozen(item) for item in value)
        if isinstance(value, dict):
            return {name: self.frozen(item) for name, item in value.items()}
        return value

    def fail(self, message: str) -> GraphCaptureError:
        error = GraphCaptureError(message)
        if self.error is None:
            self.error = error
        return error

    def snapshot(self, tensor: torch.Tensor) -> None:
        """Remember the bytes of pre-existing memory before the first write during capture."""
        key = storage_key(tensor)
        if key in self.new_storages or key in self.snapshots:
            return
        storage = tensor.untyped_storage()
        self.snapshots[key] = (storage, storage.clone())

    def restore(self) -> None:
        for storage, saved in self.snapshots.values():
            if storage.nbytes() != saved.nbytes():
                storage.resize_(saved.nbytes())
            storage.copy_(saved)
        for generator, state in self.generators.values():
            generator.set_state(state)

    def poison(self) -> None:
        for storage, dtype in self.new_storages.values():
            poison_storage(storage, dtype)


class _Recorder(TorchDispatchMode):
    """Runs and records each aten operation issued during a capture."""

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self.rec = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        rec = self.rec
        kwargs = kwargs or {}
        if rec.error is not None:
            # A refusal was swallowed by the code under capture (or raised outside the
            # dispatcher, like a compiled region): stop at the next operation.
            raise rec.error
        self._refuse(func, args, kwargs)
        info = _op_info(func)
        for position, name in info.written:
            for tensor in tensors_in(info.get(position, name, args, kwargs)):
                rec.snapshot(tensor)
        if info.generator_pos is not None:
            generator = info.get(info.generator_pos, "generator", args, kwargs)
            if generator is not None and id(generator) not in rec.generators:
                rec.generators[id(generator)] = (generator, generator.get_state())

        collective = func.overloadpacket in _COLLECTIVES
        result = _unissued(func, args, kwargs) if collective else func(*args, **kwargs)

        inputs = tensors_in((args, kwargs))
        input_keys = {storage_key(t) for t in inputs}
        flat = _leaves(result)
        fresh = []
        for index, leaf in enumerate(flat):
            if not isinstance(leaf, torch.Tensor) or _overrides_dispatch(type(leaf)):
                # a wrapper subclass (AsyncCollectiveTensor of a functional collective) holds
                # a tensor an earlier recorded operation produced; only that one is device memory
                continue
            if leaf.layout != torch.strided:
                raise rec.fail(f"{func} returned a {leaf.layout} tensor; only strided tensors")
            key = storage_key(leaf)
            if key in input_keys:
                continue  # a true view (or the written argument itself): it keeps aliasing
            rec.new_storages.setdefault(key, (leaf.untyped_storage(), leaf.dtype))
            fresh.append((index, leaf))
        rec.keepalive.append((args, kwargs, result))
        if info.metadata_only or (not info.written and not fresh):
            return result  # a view: replay keeps aliasing the same storage, nothing to run
        single = result if fresh and isinstance(result, torch.Tensor) else None
        several = tuple(fresh) if fresh and single is None else None
        run = _completing(func) if collective else func.op
        frozen_args, frozen_kwargs = rec.frozen(args), rec.frozen(kwargs)
        rec.steps.append((run, frozen_args, frozen_kwargs, single, several))
        rec.op_names.append(str(func))
        return result

    def _refuse(self, func: OpOverload, args: tuple, kwargs: dict) -> None:
        packet = func.overloadpacket
        if packet is _SET or (packet in _RESIZES and not _same_size_resize(func, args)):
            raise self.rec.fail(
                f"{func} inside graph capture moves or resizes the memory a tensor lives in; a "
                "graph needs fixed addresses: allocate tensors at their final size before capture"
            )
        if func is _LIFT_COPY:
            raise self.rec.fail(
                f"{func}: a tensor literal built from host data inside capture (a pageable "
                "host-to-device copy on a device); create it before capture and copy_ into it"
            )
        if func.namespace in COLLECTIVE_NAMESPACES and not (
            packet in _COLLECTIVES or packet.__name__ in COLLECTIVE_HELPERS
        ):
            raise self.rec.fail(
                f"{func} inside graph capture: the CPU graph records the functional collectives "
                f"{sorted(str(c) for c in _COLLECTIVES)} and a blocking dist.all_reduce only"
            )
        reason = _host_sync_reason(func, args, kwargs)
        if reason is not None:
            raise self.rec.fail(
                f"{func} is a host synchronisation inside graph capture: {reason}. Keep the value "
                "on the device (torch.where, masks, fixed shapes) or read it outside the graph"
            )


class _HostGuard(TorchFunctionMode):
    """Refuses what the dispatcher cannot see: host reads and ``torch.tensor(...)`` literals.

    ``tolist()``, ``numpy()``, ``__array__`` and ``__repr__`` (printing formats with dispatch
    modes disabled) read tensor data without a recorded aten operation, so
    the recorder would freeze the value read at capture into every replay. Literals are a
    ``lift_fresh`` of a host-built tensor at the aten level, but so is the scalar of
    ``x[idx] = 0.0`` (a device-side fill on an accelerator, which is fine); only the Python-level
    call says which is which.
    """

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self.rec = recording

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        read = _HOST_READS.get(func)
        if read is not None:
            raise self.rec.fail(
                f"{read} inside graph capture copies tensor data to the host (a device-to-host "
                "synchronisation a device capture rejects; a replay would reuse the value read "
                "at capture). Keep the value on the device (torch.where, masks) or read it "
                "outside the graph"
            )
        if getattr(func, "__module__", None) == C10D_MODULE:
            return _record_collective(self.rec, func, args, kwargs or {})
        if func in _LITERAL_CONSTRUCTORS:
            position = int(func is torch.Tensor.new_tensor)  # new_tensor(self, data)
            data = args[position] if len(args) > position else (kwargs or {}).get("data")
            if not isinstance(data, torch.Tensor):
                owner = "Tensor" if position else "torch"
                raise self.rec.fail(
                    f"{owner}.{func.__name__}(...) inside graph capture copies host data into a "
                    "new tensor (aten.lift_fresh; a pageable host-to-device copy on a device). "
                    "Create the tensor before capture and copy_ new values into it"
                )
        return func(*args, **(kwargs or {}))


def _record_collective(
    rec: _Recording, func: Callable[..., Any], args: tuple, kwargs: dict
) -> None:
    """Issue a ``torch.distributed`` collective so that the capture records it.

    ``dist.all_reduce`` calls the process group directly, past the dispatcher, so the recorder
    would see nothing and a replay would skip the collective. A blocking ``all_reduce`` is issued
    as the functional collective it equals (``_c10d_functional.all_reduce_`` and its wait),
    which the recorder sees; any other ``torch.distributed`` collective is refused.
    """
    if func is dist.all_reduce:
        tensor = args[0] if args else kwargs["tensor"]
        op = args[1] if len(args) > 1 else kwargs.get("op", dist.ReduceOp.SUM)
        group = args[2] if len(args) > 2 else kwargs.get("group")
        async_op = args[3] if len(args) > 3 else kwargs.get("async_op", False)
        name = _REDUCE_OP_NAMES.get(op)
        if name is not None and not async_op and not tensor.is_complex():
            group_name = (group or dist.group.WORLD).group_name
            FUNCTIONAL_COLLECTIVES.all_reduce_(tensor, name, group_name)
            FUNCTIONAL_COLLECTIVES.wait_tensor(tensor)
            return None
    raise rec.fail(
        f"torch.distributed.{func.__name__}(...) inside graph capture: the CPU graph records "
        "a blocking dist.all_reduce (sum, avg, product, min, max) and functional collectives "
        "(torch.distributed._functional_collectives, DTensor redistribution) only"
    )


def _refuse_compiled() -> bool:
    """Record a refusal if a compiled region is entered during a capture on this thread.

    Compiled (inductor) code runs its own kernels without the dispatcher, so nothing would be
    recorded. The region then runs eagerly (its state stays consistent) and the capture fails at
    the next dispatched operation or at capture end.
    """
    recording = getattr(_tls, "recording", None)
    if recording is None:
        return False
    recording.fail(
        "a torch.compile'd region was entered inside graph capture: compiled kernels bypass "
        "the aten dispatcher, so the CPU graph cannot record them. Capture the eager module "
        "(or torch.compiler.disable the region) for CPU graphs"
    )
    return True


class CPUGraph:
    """A graph of recorded aten operations with device-graph capture and replay semantics.

    ``with graph.capture(): ...`` records; ``graph.replay()`` re-runs the recording on the same
    tensors. One capture per graph: capturing again without :meth:`reset` raises, as re-capturing a
    live device graph would silently invalidate the addresses its callers hold.
    """

    def __init__(self) -> None:
        self._steps: tuple[_Step, ...] = ()
        self._op_names: tuple[str, ...] = ()
        self._keepalive: list[Any] = []
        self._storages: frozenset[int] = frozenset()
        self._state = "empty"  # empty | capturing | captured | failed
        self._failure = ""

    # ---- introspection --------------------------------------------------------------------
    @property
    def num_ops(self) -> int:
        """How many operations a replay executes (pure views are not re-run)."""
        return len(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def op_names(self) -> tuple[str, ...]:
        """The replayed operations in order, e.g. ``"aten.mm.default"``; for debugging."""
        return self._op_names

    def __repr__(self) -> str:
        return f"<CPUGraph {self._state} ops={self.num_ops}>"

    # ---- capture --------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the aten operations issued inside the ``with`` block into this graph.

        On exit (normal or not) memory that existed before capture is restored, memory allocated
        during capture is poisoned and the RNG state is restored. If anything inside was refused
        (even when the code under capture caught the error) the capture fails with
        :class:`GraphCaptureError` and this graph stays unusable until :meth:`reset`.
        """
        if is_capturing():
            raise GraphCaptureError(
                "a capture is already in progress on this thread; graphs cannot be nested"
            )
        if self._state != "empty":
            raise GraphCaptureError(
                f"this graph already holds a capture ({self._state}); call reset() first or "
                "create a new graph"
            )
        recording = _Recording()
        default_generator = torch.default_generator
        recording.generators[id(default_generator)] = (
            default_generator,
            default_generator.get_state(),
        )
        refuse_compiled_regions(_refuse_compiled)
        self._state = "capturing"
        _tls.graph, _tls.recording = self, recording
        error: BaseException | None = None
        try:
            with _HostGuard(recording), _Recorder(recording):
                yield
        except BaseException as exc:
            error = exc
        finally:
            _tls.graph = _tls.recording = None
            recording.restore()
            recording.poison()
        if error is None and recording.error is not None:
            error = recording.error
        if error is not None:
            self._state = "failed"
            self._failure = str(error) or type(error).__name__
            raise error
        self._steps = tuple(recording.steps)
        self._op_names = tuple(recording.op_names)
        self._keepalive = recording.keepalive
        self._storages = frozenset(storage_key(t) for t in tensors_in(recording.keepalive))
        self._state = "captured"

    def reset(self) -> None:
        """Forget the capture (releasing its tensors) so the graph can capture again."""
        if self._state == "capturing":
            raise GraphCaptureError("cannot reset a graph while it is capturing")
        self._steps, self._op_names, self._keepalive = (), (), []
        self._storages = frozenset()
        self._state, self._failure = "empty", ""

    # ---- replay ---------------------------------------------------------------------------
    def replay(self) -> None:
        """Re-run the recorded operations on the recorded tensors; no Python model code runs.

        Runs under inference mode: a replay builds no autograd graph (as a device graph does
        not), and it can write into tensors whether they were captured under ``no_grad`` or
        ``inference_mode``. Autocast is off: the recorded ops already carry the casts made at
        capture, and a device graph would not apply an ambient autocast to them again.
        """
        if self._state != "captured":
            raise GraphcapError(self._not_replayable())
        if RELEASED_STORAGES and _released(self._storages):
            raise GraphcapError(
                "replay() of a graph whose memory was released (a sleeping engine's region): "
                "restore the region (wake the engine) before replaying"
            )
        with torch.inference_mode(), torch.autocast("cpu", enabled=False):
            for func, args, kwargs, single, several in self._steps:
                result = func(*args, **kwargs)
                if single is not None:
                    single.copy_(result)
                elif several is not None:
                    flat = _leaves(result)
                    for index, recorded in several:
                        recorded.copy_(flat[index])

    def _not_replayable(self) -> str:
        if self._state == "empty":
            return "replay() of a graph that holds no capture; capture into it first"
        if self._state == "capturing":
            return "replay() of a graph while it is still capturing"
        return f"replay() of a graph whose capture failed ({self._failure}); reset() and recapture"


class ReferenceGraphs:
    """The CPU graphs in the form of a device module's graph API (the CUDA one's), so a
    :class:`~graphcap.backend.GraphBackend` captures with them as with a device's. Pools and
    streams have no meaning on the CPU: there is one stream (``None``) and no shared pool."""

    CPUGraph = CPUGraph

    @staticmethod
    def graph(
        graph: CPUGraph,
        pool: Any | None = None,
        stream: Any | None = None,
        capture_error_mode: str | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        return graph.capture()

    @staticmethod
    def is_current_stream_capturing() -> bool:
        return is_capturing()

    @staticmethod
    def graph_pool_handle() -> None:
        return None

    @staticmethod
    def current_stream() -> None:
        return None

    @staticmethod
    def set_stream(stream: Any) -> None:
        """Nothing to switch: the CPU has one stream."""
