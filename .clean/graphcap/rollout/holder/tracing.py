"""Tell transformers a graph step is being warmed up or captured, on any backend.

transformers chooses between a host path and a graph-safe path with ``is_tracing()``, whose
capture test knows one device only (``is_cuda_stream_capturing``). Under another backend's
capture its mask builder takes the host path (``padding_mask.all()``, packed-sequence checks),
so a plain forward with a 2-D mask cannot be captured there. :func:`graph_step` marks the
warm-up and the capture of a step (a context-local flag, so other threads are unaffected), and
:func:`install_capture_detection` wraps transformers' check once so it also answers True while
the flag is set. The warm-up is marked too, so it runs the code the capture records.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator

_IN_GRAPH_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "graphcap_in_graph_step", default=False
)
#: Attribute marking transformers' check as already wrapped (the patch is installed once).
_WRAPPED = "__graphcap_wrapped__"


def in_graph_step() -> bool:
    """True while a step is being warmed up or captured on this thread (any backend)."""
    return _IN_GRAPH_STEP.get()


@contextlib.contextmanager
def graph_step() -> Iterator[None]:
    """Mark the block as the warm-up or capture of a graph step."""
    token = _IN_GRAPH_STEP.set(True)
    try:
        yield
    finally:
        _IN_GRAPH_STEP.reset(token)


def install_capture_detection() -> bool:
    """Make transformers' capture check (used by ``is_tracing``) see graphcap's graph steps.

    Wraps ``transformers.utils.import_utils.is_cuda_stream_capturing``, which ``is_tracing``
    looks up at call time, so every caller sees the wrapper. Idempotent; returns False when
    this transformers has no such function (then nothing is patched).
    """
    from transformers.utils import import_utils

    original = getattr(import_utils, "is_cuda_stream_capturing", None)
    if original is None:
        return False
    if getattr(original, _WRAPPED, False):
        return True
    import_utils.is_cuda_stream_capturing = _with_graph_steps(original)
    return True


def _with_graph_steps(original: Callable[[], bool]) -> Callable[[], bool]:
    @functools.wraps(original)
    def is_capturing() -> bool:
        return in_graph_step() or original()

    setattr(is_capturing, _WRAPPED, True)
    return is_capturing
