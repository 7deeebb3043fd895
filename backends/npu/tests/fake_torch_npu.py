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
  contiguous inputs, BSH or BNSD, ``num_key_value_heads`` (0 = ``num_heads``), one mask for all
  heads in the documented shapes of its incremental (query length 1: (B, KV), (B, 1, KV),
  (B, 1, 1, KV)) and full branches ((Q, KV), (1|B, Q, KV), (1|B, 1, Q, KV)). ``inner_precise``:
  0/1 in the incremental branch; 0-3 in the full branch, where 2 and 3 correct fully masked rows
  (the double gives zeros then, NaN otherwise, as above). Host-side ``actual_seq_lengths*`` are
  refused: a capture would freeze them.

Everything is plain torch on the CPU, with no host reads, so it can run inside a CPU graph.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import math
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from graphcap_npu.probe import torch_npu_installed

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


class FakeNPUGraph:
    """Records what torch_npu's NPUGraph is asked to do, and the work itself (a CPU graph)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.replays = 0
        self.fail_at_capture_end: str | None = None
        self._recording = CPUGraph()
        self._capture: contextlib.AbstractContextManager[None] | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.events.append(("capture_begin", {"pool": pool, "mode": capture_error_mode}))
        self._capture = self._recording.capture()
        self._capture.__enter__()

    def capture_end(self) -> None:
        self.events.append(("capture_end", {}))
        capture, self._capture = self._capture, None
        assert capture is not None, "capture_end without capture_begin"
        capture.__exit__(None, None, None)  # raises what the recording refused
        if self.fail_at_capture_end:
            raise RuntimeError(self.fail_at_capture_end)

    def replay(self) -> None:
        self.replays += 1
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
        self.memory_calls: list[tuple[str, Any]] = []
        self.NPUGraph = FakeNPUGraph
        self.graph = self._make_graph_class()

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
                self.npu_graph = npu_graph
                self.pool = () if pool is None else (pool,)
                self.capture_stream = stream if stream is not None else FakeStream("capture")
                self.mode = capture_error_mode
                self._previous: FakeStream | None = None

            def __enter__(self) -> None:
                if self.capture_stream is namespace.default:
                    raise RuntimeError("capture on the default stream is not supported")
                self._previous = namespace._current
                namespace._current = self.capture_stream
                self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.mode)
                namespace._capturing = True

            def __exit__(self, *exc: object) -> None:
                namespace._capturing = False
                # Like torch_npu: capture_end runs first; if it raises, the stream stays switched.
                self.npu_graph.capture_end()
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
        }
    )
    if actual_seq_lengths is not None or actual_seq_lengths_kv is not None:
        raise AssertionError("actual_seq_lengths* are host values: a capture would freeze them")
    if pse_shift is not None or block_table is not None or sparse_mode != 0:
        raise NotImplementedError("the double models the dense defaultMask case only")
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"query dtype {query.dtype} is not supported (FLOAT16, BFLOAT16)")
    if not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
        raise RuntimeError("non-contiguous query/key/value are not supported")
    kv_heads = num_key_value_heads or num_heads
    q, k, v = _from_layout(query, key, value, num_heads, kv_heads, input_layout)
    batch, _, q_len, _ = q.shape
    kv_len = k.shape[2]
    incremental = q_len == 1
    if inner_precise not in ((0, 1) if incremental else (0, 1, 2, 3)):
        raise RuntimeError(f"inner_precise {inner_precise} is not valid for query length {q_len}")
    masked = None
    if atten_mask is not None:
        masked = _check_infer_mask(atten_mask, batch, q_len, kv_len)
    out, scores, _ = _attention(q, k, v, masked, scale, inner_precise in (2, 3))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return _to_layout(out, input_layout), lse


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


FUSION_CALLS: list[dict[str, Any]] = []
INFER_CALLS: list[dict[str, Any]] = []


def make_module(device_count: int = 1) -> tuple[types.ModuleType, FakeNPUNamespace]:
    """A fresh fake ``torch_npu`` module and the ``torch.npu`` namespace it would create."""
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    module.__version__ = "2.14.0.fake"
    namespace = FakeNPUNamespace(device_count)
    module.npu = namespace
    module.npu_fusion_attention_v3 = npu_fusion_attention_v3
    module.npu_fused_infer_attention_score = npu_fused_infer_attention_score
    FUSION_CALLS.clear()
    INFER_CALLS.clear()
    return module, namespace
