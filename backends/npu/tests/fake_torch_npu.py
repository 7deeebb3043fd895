"""A CPU test double of the parts of torch_npu graphcap-npu uses, faithful to their documentation.

It is strict where the real API is, so tests against it can fail:

* ``torch.npu.graph`` has torch_npu's signature (``auto_dispatch_capture`` before
  ``capture_error_mode``), so passing the capture mode positionally, torch.cuda-style, lands on
  the wrong parameter and is seen; capture on the default stream is refused as ACL does.
* ``NPUGraph`` really records: capture runs inside graphcap's CPU reference graph, and replay
  replays it, so a no-op capture or a host read shows up as wrong tokens or a capture error.
* ``npu_fusion_attention_v3`` computes softmax(scale * q k^T, masked) v with torch_npu's mask
  convention (bool/uint8, True = masked out), in the BSH and BNSD layouts; it refuses float
  masks, mask shapes outside SS / 11SS / B1SS / BNSS, head counts that are not whole multiples
  and the varlen TND layout (whose host-side lengths a capture would freeze); ``scale`` defaults
  to 1 as in torch_npu. A fully masked row is documented to lose precision unless
  ``inner_precise=2``: the double returns NaN for such rows then (the strictest reading of
  "unspecified") and zeros with 2.
* ``npu_fused_infer_attention_score`` (keyword-only options, as documented): fp16/bf16 only,
  contiguous inputs, BSH or BNSD, ``num_key_value_heads`` (0 = ``num_heads``; ``num_heads`` a
  multiple of it, at most 64 times), one mask for all
  heads in the documented shapes of its incremental (query length 1: (B, KV), (B, 1, KV),
  (B, 1, 1, KV)) and full branches ((Q, KV), (1|B, Q, KV), (1|B, 1, Q, KV)). ``inner_precise``:
  0/1 in the incremental branch; 0-3 in the full branch, where 2 and 3 correct fully masked rows
  (the double gives zeros then, NaN otherwise, as above). ``actual_seq_lengths_kv`` is a host
  list of ints (SymInt[]: a tensor is refused), one per row or one for all; a row attends to its
  first ``length`` columns. Page attention (``block_table``): int32, 2-D, one row per batch row
  and at least as many entries as the longest length needs; ``block_size`` a multiple of 16
  (fp16/bf16, query length 1) or 128-512 in steps of 128 (longer queries); K/V pools
  (blocknum, KV_N, block_size, D) with a BNSD query or (blocknum, block_size, H) with any; the
  lengths required; at least as many blocks as the rows' lengths need; a mask covering the
  longest row's blocks. ``actual_seq_lengths`` (queries) is refused: graphcap never passes it.
* ``NPUGraph.update(cpu_update_input=[{...}])`` sets the ``actual_seq_lengths_kv`` the next
  replays of its recorded ``npu_fused_infer_attention_score`` calls read: one dict for every call
  or one per call in capture order; refused unless the graph is marked updatable
  (``auto_dispatch_capture``). Without an update a replay reads the lengths given at capture;
  a capture without ``auto_dispatch_capture`` freezes them for good. torch_npu issues an update
  on a stream of its own that waits for nothing, so an update after a replay with no device
  synchronisation between them (it could overtake that replay) is refused.
* ``torch.npu.graph`` pushes the graph's dispatch mode (with ``auto_dispatch_capture``) before
  ``capture_begin`` and pops it only after ``capture_end`` returns, as torch_npu does: a failed
  capture leaves it on, and an infer-attention call outside a capture under it fails. A call
  captured under it (every infer-attention call; v3 outside BNSD while ``cann_9_1``) gets a
  dispatch record, and a replay of a graph holding records with no update since its last
  replay fails (torch_npu's replay would wait forever for the update's event).
* ``capture_begin`` refuses ``TASK_QUEUE_ENABLE=2``. Generators follow the double's version
  (:class:`GeneratorRules`): before 2.12.0.post3 a draw inside a capture from a generator other
  than the default one fails unless ``register_generator_state`` registered it first, and a
  capture failing at its begin or end leaves the graph's generators flagged, so every later
  draw from them outside a capture fails until a capture with them succeeds; from
  2.12.0.post3 neither, and ``register_generator_state`` warns. Page attention refuses K/V of
  more than int32-range elements each.

Everything is plain torch on the CPU, with no host reads, so it can run inside a CPU graph.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import math
import os
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from graphcap_npu.probe import release, torch_npu_installed
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)

from graphcap.cpu.graph import CPUGraph

_MASK_DTYPES = (torch.bool, torch.uint8)

#: Whether a real torch_npu is installed here (decided before any double is put in its place).
REAL_TORCH_NPU = torch_npu_installed()
#: For tests of the CPU logic that replace torch_npu, or assume it is absent: on an Ascend
#: machine they would tangle with the real one, and the cpu environment runs them anyway.
without_real_torch_npu = pytest.mark.skipif(
    REAL_TORCH_NPU,
    reason="a real torch_npu is installed here; the torch_npu-double tests run in the cpu env",
)


class FakeStream:
    def __init__(self, label: str) -> None:
        self.label = label

    def __repr__(self) -> str:
        return f"<FakeStream {self.label}>"

    def wait_stream(self, other: FakeStream) -> None:
        """Ordering only: the CPU runs everything in program order."""


class FakeGraphDispatchMode(TorchDispatchMode):
    """torch_npu's ``_GraphDispatchMode`` (an ``NPUGraph``'s ``graph_dispatch_mode``):
    ``torch.npu.graph`` pushes it (with ``auto_dispatch_capture``) before ``capture_begin`` and
    pops it after ``capture_end`` returns; a caller may also enter it around single calls. Ops
    pass through; the kernels its handlers cover ask whether it is active: during its graph's
    capture they leave a dispatch record (with a wait for the next update), outside a capture
    the infer-attention kernel fails, as torch_npu's handler would open a task group on a
    stream that is not capturing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class GeneratorRules(TorchDispatchMode):
    """torch_npu's generator rules, for every draw while the double is installed (a mode at the
    bottom of the stack, so it also sees what a capture records and what a replay re-issues).

    Before 2.12.0.post3: inside a capture, a draw from a generator the capturing graph does not
    know (the default one, those registered) raises; outside one, a draw from a generator still
    flagged by a capture that failed raises. From 2.12.0.post3 captures keep per-capture state:
    neither rule applies."""

    def __init__(self, namespace: FakeNPUNamespace) -> None:
        super().__init__()
        self.namespace = namespace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and not self.namespace.per_capture:
            given = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Generator)]
            generator = given[0] if given else torch.default_generator
            flagged = any(_same_generator(generator, g) for g in self.namespace.flagged)
            if self.namespace.is_current_stream_capturing() and not flagged:
                raise RuntimeError(
                    "Attempt to increase offset for a NPU generator not in capture mode."
                )
            if not self.namespace.is_current_stream_capturing() and flagged:
                raise RuntimeError(
                    "Offset increment outside graph capture encountered unexpectedly."
                )
        return func(*args, **kwargs)


def _same_generator(seen: torch.Generator, known: torch.Generator) -> bool:
    """Whether the generator an op received is ``known``: the dispatcher hands modes a new
    Python wrapper, so the generators are compared by seed and state (outside the capture's
    recording, which would refuse the comparison as a host read)."""
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        return seen.initial_seed() == known.initial_seed() and torch.equal(
            seen.get_state(), known.get_state()
        )


class FakeNPUGraph:
    """Records what torch_npu's NPUGraph is asked to do, and the work itself (a CPU graph)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.replays = 0
        self.fail_at_capture_end: str | None = None
        #: an ACL failure at capture begin (after torch_npu flagged the generators)
        self.fail_at_capture_begin: str | None = None
        #: set by ``torch.npu.graph`` (as torch_npu does): whether update() may be called
        self.auto_dispatch_capture = False
        #: one per call recorded under the dispatch mode, in capture order: the capture-time
        #: ``actual_seq_lengths_kv`` of an infer-attention call, ``None`` for a v3 call
        self.dispatch_records: list[list[int] | None] = []
        #: whether an update came after the last replay (each record waits for one)
        self.updated_since_replay = False
        #: what update() was given, in order
        self.updates: list[list[dict[str, Any]]] = []
        self._lengths: torch.Tensor | None = None  # the records' lengths, read by replays
        self._recording = CPUGraph()
        self._capture: contextlib.AbstractContextManager[None] | None = None
        #: what torch.npu.graph pushes around a capture with auto_dispatch_capture
        self.graph_dispatch_mode = FakeGraphDispatchMode()
        #: generators registered with register_generator_state (the default one needs none)
        self.generators: list[torch.Generator] = []
        #: the synchronisation count at the last replay (see update())
        self._replayed_at: int | None = None

    def register_generator_state(self, generator: torch.Generator) -> None:
        if self._capture is not None:
            raise RuntimeError("register a generator before the capture begins")
        if _NAMESPACE is not None and _NAMESPACE.per_capture:
            warnings.warn(
                "NPUGraph.register_generator_state() is deprecated, and will be removed in a "
                "future torch_npu release. It is now a no-op and can be safely removed from "
                "your code.",
                UserWarning,
                stacklevel=2,
            )
            return
        self.generators.append(generator)

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.events.append(("capture_begin", {"pool": pool, "mode": capture_error_mode}))
        if os.environ.get("TASK_QUEUE_ENABLE", "").strip() == "2":
            raise RuntimeError(
                "Do not support TASK_QUEUE_ENABLE = 2 during NPU graph capture, please export "
                "TASK_QUEUE_ENABLE=1/0."
            )
        if _NAMESPACE is not None and not _NAMESPACE.per_capture:
            # before ACL begins: a failure from here on leaves these flagged
            _NAMESPACE.flagged = [torch.default_generator, *self.generators]
        if self.fail_at_capture_begin:
            raise RuntimeError(self.fail_at_capture_begin)
        self.dispatch_records = []
        # allocated before recording starts, so replays read what update() writes there
        self._lengths = torch.zeros(_MAX_RECORDS, _MAX_ROWS, dtype=torch.int64)
        self._capture = self._recording.capture()
        self._capture.__enter__()

    def capture_end(self) -> None:
        self.events.append(("capture_end", {}))
        capture, self._capture = self._capture, None
        assert capture is not None, "capture_end without capture_begin"
        capture.__exit__(None, None, None)  # raises what the recording refused
        assert self._lengths is not None
        for index, lengths in enumerate(self.dispatch_records):  # what a replay reads unupdated
            if lengths is not None:
                self._lengths[index, : len(lengths)] = torch.tensor(lengths)
        if self.fail_at_capture_end:
            raise RuntimeError(self.fail_at_capture_end)
        if _NAMESPACE is not None:
            _NAMESPACE.flagged = []  # after ACL ended the capture, as torch_npu does

    def recording(self) -> bool:
        """Whether a call now is captured under this graph's dispatch mode (gets a record)."""
        return self._capture is not None and self.graph_dispatch_mode in (
            _get_current_dispatch_mode_stack()
        )

    def record_lengths(self, lengths: list[int] | None) -> torch.Tensor:
        """While :meth:`recording`: a dispatch record of one call (``None``: a v3 call, which has
        no lengths); returns the lengths its replays read (written at capture end and by
        update())."""
        if len(self.dispatch_records) == _MAX_RECORDS or len(lengths or ()) > _MAX_ROWS:
            raise NotImplementedError("the double holds 64 records of up to 1024 rows")
        assert self._lengths is not None
        self.dispatch_records.append(None if lengths is None else list(lengths))
        return self._lengths[len(self.dispatch_records) - 1, : len(lengths or ())]

    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        """torch_npu's NPUGraph.update: new host arguments for the recorded calls.

        torch_npu issues it on an update stream of its own that waits for nothing: an update
        after a replay that nothing ordered it behind (a device synchronisation) may overtake
        that replay and change the lengths it reads, so the double refuses it."""
        if not self.auto_dispatch_capture:
            raise RuntimeError(
                "The current graph configuration does not support update, Try to capture by "
                "setting auto_dispatch_capture=True during capture"
            )
        if _NAMESPACE is not None and self._replayed_at == _NAMESPACE.synchronizations:
            raise RuntimeError(
                "NPUGraph.update after a replay with nothing ordering them: the update stream "
                "may overtake the replay still queued (synchronize first)"
            )
        if not isinstance(cpu_update_input, list) or not all(
            isinstance(entry, dict) for entry in cpu_update_input
        ):
            raise TypeError("cpu_update_input must be a list of dicts")
        records = self.dispatch_records
        if len(cpu_update_input) not in (1, len(records)):
            raise ValueError(
                f"{len(cpu_update_input)} updates for {len(records)} dispatch records: give one "
                "for all or one per record"
            )
        self.updates.append(cpu_update_input)
        assert self._lengths is not None
        self.updated_since_replay = True
        for index, captured in enumerate(records):
            entry = cpu_update_input[0 if len(cpu_update_input) == 1 else index]
            if captured is None or "actual_seq_lengths_kv" not in entry:
                continue
            lengths = _host_lengths(entry["actual_seq_lengths_kv"], len(captured))
            self._lengths[index, : len(captured)] = torch.tensor(lengths)

    def replay(self) -> None:
        """Each dispatch record's captured wait needs an update since the last replay: without
        one, torch_npu's replay waits forever on an event nothing records (the double fails)."""
        if self.dispatch_records and not self.updated_since_replay:
            raise RuntimeError(
                f"replay of a graph with {len(self.dispatch_records)} dispatch records and no "
                "NPUGraph.update since its last replay: each record's ExternalEvent wait never "
                "returns (the device hangs)"
            )
        self.updated_since_replay = False
        self.replays += 1
        if _NAMESPACE is not None:
            self._replayed_at = _NAMESPACE.synchronizations
        self._recording.replay()

    def pool(self) -> tuple[str, int]:
        return ("pool-of", id(self))


class FakeNPUNamespace(types.SimpleNamespace):
    """Stands in for ``torch.npu`` (created by ``import torch_npu``)."""

    def __init__(self, device_count: int = 1) -> None:
        super().__init__()
        self.default = FakeStream("default")
        self._current = self.default
        self._capturing = False
        #: NPUs the fake reports (a test sets 0 for a host whose devices are hidden).
        self.visible_devices = device_count
        self.graph_calls: list[dict[str, Any]] = []
        #: the graph a capture in progress records into
        self.capturing_graph: FakeNPUGraph | None = None
        self.memory_calls: list[tuple[str, Any]] = []
        #: device synchronisations so far (what orders an update after earlier replays)
        self.synchronizations = 0
        #: whether the CANN toolkit is 9.1.0 or later (torch_npu's v3 graph handler applies)
        self.cann_9_1 = True
        #: the generators in capture mode (before 2.12.0.post3: set at capture begin, cleared
        #: only by a capture that ended)
        self.flagged: list[torch.Generator] = []
        #: the ``torch_npu`` module this namespace belongs to (its version decides rules)
        self.module: types.ModuleType | None = None
        self.generator_rules = GeneratorRules(self)
        self.NPUGraph = FakeNPUGraph
        self.graph = self._make_graph_class()

    @property
    def per_capture(self) -> bool:
        """Whether the double's version keeps generator state per capture (2.12.0.post3 on)."""
        found = release(str(getattr(self.module, "__version__", "")))
        return found is not None and found >= (2, 12, 0, 3)

    # ---- streams and device --------------------------------------------------------------
    def Stream(self) -> FakeStream:
        return FakeStream("side")

    def current_stream(self, device: Any = None) -> FakeStream:
        return self._current

    def set_stream(self, stream: FakeStream) -> None:
        self._current = stream

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        previous, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = previous

    def is_available(self) -> bool:
        return self.visible_devices > 0

    def device_count(self) -> int:
        return self.visible_devices

    def current_device(self) -> int:
        return 0

    def synchronize(self, device: Any = None) -> None:
        if self._capturing:
            raise RuntimeError("synchronize is not allowed during capture")
        self.synchronizations += 1

    def memory_allocated(self, device: Any = None) -> int:
        self.memory_calls.append(("memory_allocated", device))
        return 1234

    def max_memory_allocated(self, device: Any = None) -> int:
        self.memory_calls.append(("max_memory_allocated", device))
        return 5678

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.memory_calls.append(("reset_peak_memory_stats", device))

    def empty_cache(self) -> None:
        self.memory_calls.append(("empty_cache", None))

    # ---- graphs --------------------------------------------------------------------------
    def graph_pool_handle(self) -> tuple[str, str]:
        return ("pool", "handle")

    def is_current_stream_capturing(self) -> bool:
        return self._capturing

    def _make_graph_class(self) -> type:
        namespace = self

        class graph:
            """Same parameters, in the same order, as torch_npu's ``torch.npu.graph``."""

            def __init__(
                self,
                npu_graph: FakeNPUGraph,
                pool: Any = None,
                stream: FakeStream | None = None,
                auto_dispatch_capture: bool = False,
                capture_error_mode: str = "global",
            ) -> None:
                namespace.graph_calls.append(
                    {
                        "graph": npu_graph,
                        "pool": pool,
                        "stream": stream,
                        "auto_dispatch_capture": auto_dispatch_capture,
                        "capture_error_mode": capture_error_mode,
                    }
                )
                if not isinstance(auto_dispatch_capture, bool):
                    raise TypeError("auto_dispatch_capture must be a bool")
                npu_graph.auto_dispatch_capture = auto_dispatch_capture
                self.npu_graph = npu_graph
                self.pool = () if pool is None else (pool,)
                self.capture_stream = stream if stream is not None else FakeStream("capture")
                self.mode = capture_error_mode
                self._previous: FakeStream | None = None

            def __enter__(self) -> None:
                if self.capture_stream is namespace.default:
                    raise RuntimeError("capture on the default stream is not supported")
                namespace.synchronize()
                self._previous = namespace._current
                namespace._current = self.capture_stream
                if self.npu_graph.auto_dispatch_capture:
                    self.npu_graph.graph_dispatch_mode.__enter__()
                self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.mode)
                namespace._capturing = True
                namespace.capturing_graph = self.npu_graph

            def __exit__(self, *exc: object) -> None:
                namespace._capturing = False
                namespace.capturing_graph = None
                # Like torch_npu: capture_end runs first; if it raises, neither the dispatch
                # mode nor the stream is restored.
                self.npu_graph.capture_end()
                if self.npu_graph.auto_dispatch_capture:
                    self.npu_graph.graph_dispatch_mode.__exit__(*exc)
                namespace._current = self._previous

        return graph


def npu_fusion_attention_v3(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: torch.Tensor | None = None,
    actual_seq_kvlen: torch.Tensor | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
) -> tuple[torch.Tensor, ...]:
    FUSION_CALLS.append(
        {
            "head_num": head_num,
            "input_layout": input_layout,
            "atten_mask": atten_mask,
            "scale": scale,
            "keep_prob": keep_prob,
            "inner_precise": inner_precise,
            "sparse_mode": sparse_mode,
            "actual_seq_qlen": actual_seq_qlen,
        }
    )
    if input_layout == "TND":
        raise AssertionError("TND takes host-side sequence lengths: never used under a graph")
    graph = _NAMESPACE.capturing_graph if _NAMESPACE is not None else None
    if graph is not None and graph.recording() and _NAMESPACE.cann_9_1 and input_layout != "BNSD":
        graph.record_lengths(None)  # torch_npu's v3 handler: every layout but BNSD, CANN >= 9.1
    if pse is not None or padding_mask is not None or sparse_mode != 0 or keep_prob != 1.0:
        raise NotImplementedError("the double models defaultMask without pse or dropout")
    q, k, v = _from_layout(query, key, value, head_num, None, input_layout)
    batch, q_heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    masked = None
    if atten_mask is not None:
        masked = _check_mask(atten_mask, batch, q_heads, q_len, kv_len).bool()
    out, scores, probs = _attention(q, k, v, masked, scale, inner_precise == 2)
    softmax_max = scores.amax(dim=-1, keepdim=True)
    softmax_sum = probs.sum(dim=-1, keepdim=True)
    empty = torch.empty(0)
    seed = torch.zeros(1, dtype=torch.int64)
    offset = torch.zeros(1, dtype=torch.int64)
    return _to_layout(out, input_layout), softmax_max, softmax_sum, empty, seed, offset


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: list[int] | None = None,
    actual_seq_lengths_kv: list[int] | None = None,
    block_table: torch.Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 2147483647,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    INFER_CALLS.append(
        {
            "num_heads": num_heads,
            "num_key_value_heads": num_key_value_heads,
            "input_layout": input_layout,
            "atten_mask": atten_mask,
            "scale": scale,
            "inner_precise": inner_precise,
            "actual_seq_lengths_kv": actual_seq_lengths_kv,
            "block_table": block_table,
            "block_size": block_size,
            "key_shape": tuple(key.shape),
        }
    )
    moded = any(isinstance(m, FakeGraphDispatchMode) for m in _get_current_dispatch_mode_stack())
    if moded and (_NAMESPACE is None or not _NAMESPACE.is_current_stream_capturing()):
        raise RuntimeError(
            "graph_task_group_begin on a stream that is not capturing: a graph dispatch mode "
            "outlived its capture"
        )
    if actual_seq_lengths is not None:
        raise NotImplementedError("the double models actual_seq_lengths_kv only")
    if block_table is not None and max(key.numel(), value.numel()) > POOL_ELEMENT_LIMIT:
        raise RuntimeError(
            f"key/value of {key.numel()} elements exceed the int32 range page attention takes"
        )
    if pse_shift is not None or sparse_mode != 0:
        raise NotImplementedError("the double models the defaultMask case only")
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"query dtype {query.dtype} is not supported (FLOAT16, BFLOAT16)")
    if not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
        raise RuntimeError("non-contiguous query/key/value are not supported")
    kv_heads = num_key_value_heads or num_heads
    if num_heads % kv_heads or num_heads // kv_heads > 64:
        raise RuntimeError(f"num_heads {num_heads} must be 1-64 times num_key_value_heads")
    batch, q_len = query.shape[0], query.shape[2] if input_layout == "BNSD" else query.shape[1]
    lengths = None
    if actual_seq_lengths_kv is not None:
        lengths = _host_lengths(actual_seq_lengths_kv, batch)  # recorded with its lengths
    elif (graph := _NAMESPACE and _NAMESPACE.capturing_graph) and graph.recording():
        graph.record_lengths(None)  # torch_npu records every call
    if block_table is not None:
        if lengths is None:
            raise RuntimeError("page attention needs actual_seq_lengths_kv")
        key, value = _paged_kv(query, key, value, block_table, block_size, lengths, input_layout)
        key_layout = "BNSD"
    else:
        key_layout = input_layout
    q, _, _ = _from_layout(query, query, query, num_heads, None, input_layout)
    _, k, v = _from_layout(key, key, value, kv_heads, kv_heads, key_layout)
    if q.shape[1] % k.shape[1]:
        raise RuntimeError("Nq / Nkv must be a whole number")
    if q.shape[-1] != k.shape[-1] or q.dtype != k.dtype:
        raise RuntimeError("query and key must share head_dim and dtype")
    kv_len = k.shape[2]
    incremental = q_len == 1
    if inner_precise not in ((0, 1) if incremental else (0, 1, 2, 3)):
        raise RuntimeError(f"inner_precise {inner_precise} is not valid for query length {q_len}")
    masked = None
    if atten_mask is not None:
        if block_table is not None and atten_mask.shape[-1] < kv_len:
            raise RuntimeError(
                f"atten_mask covers {atten_mask.shape[-1]} columns, fewer than the block table's "
                f"{kv_len}"
            )
        width = kv_len if block_table is None else atten_mask.shape[-1]
        masked = _check_infer_mask(atten_mask, batch, q_len, width)[..., :kv_len]
    if lengths is not None:
        if max(lengths) > kv_len:
            raise RuntimeError(f"actual_seq_lengths_kv {lengths} exceed the key length {kv_len}")
        beyond = torch.arange(kv_len)[None] >= _lengths_tensor(lengths)[:, None]
        beyond = beyond[:, None, None, :]
        masked = beyond if masked is None else masked | beyond
    out, scores, _ = _attention(q, k, v, masked, scale, inner_precise in (2, 3))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return _to_layout(out, input_layout), lse


def _host_lengths(lengths: Any, batch: int) -> list[int]:
    """``actual_seq_lengths_kv`` as torch_npu reads it: a host int list (SymInt[]), one entry
    for every row or at least one per row (the first ``batch`` are used)."""
    if isinstance(lengths, torch.Tensor) or not isinstance(lengths, (list, tuple)):
        raise TypeError(f"actual_seq_lengths_kv must be a list of ints, not {type(lengths)}")
    if not all(type(value) is int for value in lengths):
        raise TypeError(f"actual_seq_lengths_kv must hold Python ints: {lengths!r}")
    if len(lengths) == 1:
        return list(lengths) * batch
    if len(lengths) < batch:
        raise RuntimeError(f"{len(lengths)} actual_seq_lengths_kv for a batch of {batch}")
    if min(lengths[:batch]) < 0:
        raise RuntimeError(f"negative actual_seq_lengths_kv {lengths}")
    return list(lengths[:batch])


def _lengths_tensor(lengths: list[int]) -> torch.Tensor:
    """The lengths a kernel reads: eager, the host values; in an ``auto_dispatch_capture``
    capture, a record whose replays read update()'s values; in any other capture, the values
    frozen into the graph."""
    graph = _NAMESPACE.capturing_graph if _NAMESPACE is not None else None
    if graph is None:
        return torch.tensor(lengths)
    if graph.recording():
        return graph.record_lengths(lengths)
    return torch.cat([torch.full((1,), value, dtype=torch.int64) for value in lengths])


def _paged_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    block_size: int,
    lengths: list[int],
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page attention's documented constraints, then each row's K/V gathered through the table
    as (B, KV_N, entries * block_size, D)."""
    batch = query.shape[0]
    q_len = query.shape[2] if layout == "BNSD" else query.shape[1]
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != batch:
        raise RuntimeError(
            f"block_table must be int32 (B, maxBlockNumPerSeq) with B = {batch}; got "
            f"{table.dtype} {tuple(table.shape)}"
        )
    if key.dim() == 4 and layout != "BNSD":
        raise RuntimeError("a (blocknum, KV_N, blocksize, D) cache needs a BNSD or TND query")
    if q_len == 1 and (block_size <= 0 or block_size % 16):
        raise RuntimeError(f"block_size {block_size} must be a positive multiple of 16")
    if q_len > 1 and (block_size % 128 or not 128 <= block_size <= 512):
        raise RuntimeError(f"block_size {block_size} must be 128-512 in steps of 128")
    if key.shape != value.shape:
        raise RuntimeError("key and value must have one shape")
    if key.dim() not in (3, 4) or key.shape[-2 if key.dim() == 4 else 1] != block_size:
        raise RuntimeError(f"K/V cache {tuple(key.shape)} does not hold blocks of {block_size}")
    needed = [-(-length // block_size) for length in lengths]
    if table.shape[1] < max(needed):
        raise RuntimeError(f"block_table has {table.shape[1]} entries; lengths need {max(needed)}")
    if key.shape[0] < sum(needed):
        raise RuntimeError(f"{key.shape[0]} blocks, fewer than the lengths need ({sum(needed)})")
    if key.dim() == 3:  # (blocknum, blocksize, H) -> (blocknum, KV_N, blocksize, D)
        dim = query.shape[-1] if layout == "BNSD" else None
        if dim is None:
            raise NotImplementedError("the double pages BNSD queries only")
        key = key.view(key.shape[0], block_size, -1, dim).transpose(1, 2)
        value = value.view(value.shape[0], block_size, -1, dim).transpose(1, 2)
    entries = table.shape[1]

    def gather(pool: torch.Tensor) -> torch.Tensor:
        picked = pool.index_select(0, table.reshape(-1).long())  # (B * entries, N, bs, D)
        picked = picked.view(batch, entries, *pool.shape[1:]).transpose(1, 2)
        return picked.reshape(batch, pool.shape[1], entries * block_size, pool.shape[-1])

    return gather(key).contiguous(), gather(value).contiguous()


def _from_layout(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    heads: int,
    kv_heads: int | None,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v as (B, N, S, D) from BNSD or BSH memory, with the documented shape checks."""
    if not query.dtype == key.dtype == value.dtype:
        raise RuntimeError("query, key and value must share one dtype")
    if key.shape != value.shape:
        raise RuntimeError("key and value must have one shape")
    if layout == "BNSD":
        if query.shape[1] != heads:
            raise RuntimeError(f"head count {heads} does not match the query's N {query.shape[1]}")
        if kv_heads is not None and key.shape[1] != kv_heads:
            raise RuntimeError(f"num_key_value_heads {kv_heads} != key's N {key.shape[1]}")
        q, k, v = query, key, value
    elif layout == "BSH":
        if query.shape[-1] % heads:
            raise RuntimeError(f"H {query.shape[-1]} is not a multiple of the head count {heads}")
        dim = query.shape[-1] // heads
        if key.shape[-1] % dim:
            raise RuntimeError("the key's H is not a whole number of heads")
        if kv_heads is not None and key.shape[-1] != kv_heads * dim:
            raise RuntimeError(f"num_key_value_heads {kv_heads} does not match the key's H")
        q = query.view(query.shape[0], query.shape[1], heads, dim).transpose(1, 2)
        k = key.view(key.shape[0], key.shape[1], -1, dim).transpose(1, 2)
        v = value.view(value.shape[0], value.shape[1], -1, dim).transpose(1, 2)
    else:
        raise NotImplementedError(f"the double models BSH and BNSD only, not {layout}")
    if q.shape[1] % k.shape[1]:
        raise RuntimeError("Nq / Nkv must be a whole number")
    return q, k, v


def _to_layout(out: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return out
    batch, heads, seq, dim = out.shape
    return out.transpose(1, 2).reshape(batch, seq, heads * dim)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masked: torch.Tensor | None,
    scale: float,
    correct_invalid_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(scale q k^T, masked) v in fp32 with grouped K/V heads; a fully masked row is NaN
    unless ``correct_invalid_rows`` (then zeros)."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    k = k[:, :, None].expand(batch, kv_heads, group, kv_len, head_dim)
    v = v[:, :, None].expand(batch, kv_heads, group, kv_len, head_dim)
    k = k.reshape(batch, q_heads, kv_len, head_dim).float()
    v = v.reshape(batch, q_heads, kv_len, head_dim).float()
    scores = q.float() @ k.transpose(-1, -2) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, -math.inf)
    probs = torch.softmax(scores, dim=-1)  # a fully masked row: all -inf -> NaN
    out = probs @ v
    if masked is not None and correct_invalid_rows:
        invalid = masked.expand(batch, q_heads, q_len, kv_len).all(dim=-1, keepdim=True)
        out = torch.where(invalid, torch.zeros_like(out), out)
    return out.to(q.dtype), scores, probs


def _check_mask(
    mask: torch.Tensor, batch: int, heads: int, q_len: int, kv_len: int
) -> torch.Tensor:
    if mask.dtype not in _MASK_DTYPES:
        raise RuntimeError(f"atten_mask must be bool or uint8, not {mask.dtype}")
    shape = tuple(mask.shape)
    allowed = {(q_len, kv_len), (1, 1, q_len, kv_len), (batch, 1, q_len, kv_len)}
    allowed.add((batch, heads, q_len, kv_len))
    if shape not in allowed:
        raise RuntimeError(f"atten_mask shape {shape} is not SS, 11SS, B1SS or BNSS")
    return mask


def _check_infer_mask(mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The documented mask shapes of npu_fused_infer_attention_score, as (B|1, 1, Q, KV) bool."""
    if mask.dtype not in (torch.bool, torch.int8, torch.uint8):
        raise RuntimeError(f"atten_mask must be bool, int8 or uint8, not {mask.dtype}")
    shape = tuple(mask.shape)
    if q_len == 1:
        allowed = {(batch, kv_len), (batch, 1, kv_len), (batch, 1, 1, kv_len)}
    else:
        allowed = {(q_len, kv_len), (1, q_len, kv_len), (batch, q_len, kv_len)}
        allowed |= {(1, 1, q_len, kv_len), (batch, 1, q_len, kv_len)}
    if shape not in allowed:
        raise RuntimeError(f"atten_mask shape {shape} is not documented for query length {q_len}")
    if q_len == 1:
        return mask.reshape(batch, 1, 1, kv_len).bool()
    return mask.reshape(-1, 1, q_len, kv_len).bool()


#: Page attention's limit on the elements of each of key and value (int32 range).
POOL_ELEMENT_LIMIT = 2**31 - 1
FUSION_CALLS: list[dict[str, Any]] = []
INFER_CALLS: list[dict[str, Any]] = []
_MAX_RECORDS, _MAX_ROWS = 64, 1024
#: the namespace of the module make_module() made last (the kernels ask it about captures)
_NAMESPACE: FakeNPUNamespace | None = None


def make_module(device_count: int = 1) -> tuple[types.ModuleType, FakeNPUNamespace]:
    """A fresh fake ``torch_npu`` module and the ``torch.npu`` namespace it would create."""
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    module.__version__ = "2.14.0.fake"
    global _NAMESPACE
    namespace = _NAMESPACE = FakeNPUNamespace(device_count)
    namespace.module = module
    module.npu = namespace
    module.npu_fusion_attention_v3 = npu_fusion_attention_v3
    module.npu_fused_infer_attention_score = npu_fused_infer_attention_score
    FUSION_CALLS.clear()
    INFER_CALLS.clear()
    return module, namespace
