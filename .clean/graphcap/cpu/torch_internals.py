"""The torch internals the CPU reference graph cannot do without, each with the reason.

The CPU graph records the aten operations of a capture and replays them; seeing and describing
aten operations is dispatcher machinery, part of which torch exposes only under private names.
Everything :mod:`graphcap.cpu.graph` relies on that torch does not promise lives here and nowhere
else in graphcap. Checked against torch 2.11.0 (the GPU machine's) and 2.13.0 (CI's):
``tests/test_torch_internals.py`` pins each name and the behaviour the graph relies on, so an
upgrade that moves or changes one fails there, naming it, instead of as a wrong token somewhere
in a rollout.

* :class:`TorchDispatchMode` (``torch.utils._python_dispatch``): the one hook that sees every
  aten operation below autograd, which is what a capture records. torch's extending guide
  imports it from this path; there is no public alias.
* :class:`OpOverload` (``torch._ops``): the type of the operations a dispatch mode receives
  (``torch.library`` annotates its own arguments with this path too). Used for annotations and
  the pinning test.
* :func:`schema_arguments` (``OpOverload._schema``): argument names, positions and
  ``alias_info.is_write`` (the arguments an in-place or ``out=`` operation writes, which a capture
  must snapshot and restore). ``OpOverload`` has no public schema accessor.
* :func:`storage_key` (``UntypedStorage._cdata``): the identity of the memory a tensor lives in,
  shared by all its views. ``data_ptr()`` is not one: every empty storage has a null pointer.
* The operator tags (``torch.Tag``) the host-synchronisation rule reads: the enum is public, but
  which operators carry which tag is torch's choice, so the test pins the ones the rule needs.
* :data:`INDEX_PUT_IMPL` (``aten._index_put_impl_``): the implementation op behind
  ``index_put_``, issued directly by decompositions; with a boolean mask it is the same hidden
  ``nonzero`` as ``index_put_``.
* :data:`FUNCTIONAL_COLLECTIVES` (``torch.ops._c10d_functional``): the operators of
  ``torch.distributed``'s functional collectives (what DTensor and tensor-parallel models issue),
  which a capture records and a replay issues again; ``_wrap_tensor_autograd`` among
  :data:`COLLECTIVE_HELPERS` is registered from ``torch.distributed._functional_collectives``.
* :data:`C10D_MODULE`: the module ``dist.all_reduce`` and the other blocking collectives are
  defined in, which is how a ``TorchFunctionMode`` tells them apart.
* :func:`refuse_compiled_regions` (``torch._dynamo.eval_frame._callback_from_stance``): every
  entry into a ``torch.compile``'d region asks it for the frame callback to install; compiled
  kernels bypass the dispatcher, so a capture must refuse them, and nothing public reports such
  an entry.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "C10D_MODULE",
    "COLLECTIVE_HELPERS",
    "COLLECTIVE_NAMESPACES",
    "DATA_DEPENDENT_OUTPUT",
    "DYNAMIC_OUTPUT_SHAPE",
    "FUNCTIONAL_COLLECTIVES",
    "INDEX_PUT_IMPL",
    "INPLACE_VIEW",
    "OpOverload",
    "TorchDispatchMode",
    "refuse_compiled_regions",
    "schema_arguments",
    "storage_key",
]

#: Tag of operators returning a host value computed from tensor data (``_local_scalar_dense``).
DATA_DEPENDENT_OUTPUT = torch.Tag.data_dependent_output
#: Tag of operators whose output shape depends on tensor data (``nonzero``, ``masked_select``).
DYNAMIC_OUTPUT_SHAPE = torch.Tag.dynamic_output_shape
#: Tag of in-place operators that change only sizes and strides (``t_``, ``unsqueeze_``).
INPLACE_VIEW = torch.Tag.inplace_view

INDEX_PUT_IMPL = torch.ops.aten._index_put_impl_.default

#: Looked up lazily by torch: an operator of it exists only in a build with distributed.
FUNCTIONAL_COLLECTIVES = torch.ops._c10d_functional
#: Operator namespaces of collectives (the process-group ops and the functional ones).
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional"})
#: Operators of those namespaces that communicate nothing.
COLLECTIVE_HELPERS = frozenset({"wait_tensor", "_wrap_tensor_autograd"})
C10D_MODULE = "torch.distributed.distributed_c10d"

#: Marks the wrapper :func:`refuse_compiled_regions` installs, so it is installed once.
_GUARD_MARK = "_graphcap_guard"


def schema_arguments(func: OpOverload) -> Sequence[Any]:
    """The schema's arguments of ``func`` (``name``, ``alias_info``), in positional order."""
    return func._schema.arguments


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the memory a tensor lives in, the same for all its views."""
    return tensor.untyped_storage()._cdata


def refuse_compiled_regions(refuse: Callable[[], bool]) -> None:
    """Ask ``refuse()`` at every entry into a ``torch.compile``'d region; True runs it eagerly.

    Compiled code runs its own kernels, past the dispatcher, so a recording dispatch mode would
    see nothing. Every dynamo entry point (a compiled function or module, a
    ``torch._dynamo.optimize`` / ``run`` context) asks ``eval_frame._callback_from_stance`` which
    frame callback to install; the wrapper answers ``None`` (no dynamo) when ``refuse()`` says so.
    ``torch.compiler.disable``d regions ask for ``None`` themselves and are never refused.
    Installed once per process (later calls keep the first ``refuse``); a no-op until dynamo
    is imported, when no compiled region exists yet.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return
    original = getattr(eval_frame, "_callback_from_stance", None)
    if original is None or getattr(original, _GUARD_MARK, False):
        return

    def guarded(callback: Any) -> Any:
        if callback is not None and refuse():
            return None
        return original(callback)

    setattr(guarded, _GUARD_MARK, True)
    eval_frame._callback_from_stance = guarded
