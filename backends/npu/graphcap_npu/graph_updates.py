"""Which captured calls ``NPUGraph.update`` may change, and the rule every such graph follows.

torch_npu makes a call updatable by capturing it under the graph's dispatch mode (what
``torch.npu.graph(..., auto_dispatch_capture=True)`` pushes for the whole capture): the mode
records the call, and it captures, before the call, a wait on an event that only
``NPUGraph.update`` records (and a reset of it). So every replay of a graph holding such a record
waits for an update issued since the replay before it; without one the device waits forever.

graphcap-npu therefore never captures a whole step under the mode. Only the call whose host
arguments the engine sets before every replay (page attention's ``actual_seq_lengths_kv``) runs
under it (:func:`updatable`); every other kernel torch_npu handles (every
``npu_fused_infer_attention_score`` call, ``npu_fusion_attention_v3`` outside BNSD on CANN 9.1 or
later) is captured as a plain operator, with no wait. A graph holding a record is marked
updatable once its capture succeeded, and :func:`check_replay` refuses to replay it without an
update first: an error here, instead of a hung device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

#: The graph a capture through NPUBackend.capture_to_graph records into, while it runs.
_CAPTURING: ContextVar[Any | None] = ContextVar("graphcap_npu_capturing", default=None)
#: Attribute set on a graph holding records: whether an update came after its last replay.
_UPDATED = "graphcap_updated"


@contextlib.contextmanager
def capturing(graph: Any) -> Iterator[None]:
    """Within the block ``graph`` is being captured; afterwards, when a call recorded itself
    (:func:`updatable`), ``graph`` is updatable (torch_npu's ``update`` checks the flag the
    dispatch mode's owner sets) and waits for its first update."""
    token = _CAPTURING.set(graph)
    try:
        yield
    finally:
        _CAPTURING.reset(token)
    if getattr(graph, _UPDATED, None) is not None:
        graph.auto_dispatch_capture = True


@contextlib.contextmanager
def updatable() -> Iterator[None]:
    """Run the block's kernel call under the capturing graph's dispatch mode, so
    ``NPUGraph.update`` can set its host arguments before each replay; eagerly, nothing."""
    graph = _CAPTURING.get()
    if graph is None:
        yield
        return
    setattr(graph, _UPDATED, False)
    with graph.graph_dispatch_mode:
        yield


def is_updatable(graph: Any) -> bool:
    """Whether ``graph`` holds calls recorded for update (each replay needs one first)."""
    return getattr(graph, _UPDATED, None) is not None


def updated(graph: Any) -> None:
    """An update of ``graph`` was issued: its next replay may run."""
    setattr(graph, _UPDATED, True)


def check_replay(graph: Any) -> None:
    """Refuse a replay that would wait for an update nothing issued; else count it."""
    if getattr(graph, _UPDATED, None) is False:
        raise RuntimeError(
            "this NPU graph holds page-attention calls recorded for NPUGraph.update, and no "
            "update came since its last replay: its replay would wait forever for the update's "
            "event. Call NPUBackend.update_graph_kv_lengths before every replay of it."
        )
    if is_updatable(graph):
        setattr(graph, _UPDATED, False)
