"""FSDP2's parameters unsharded once for a call, outside the captured region.

FSDP2 (``torch.distributed.fsdp.fully_shard``) all-gathers a module's parameters in a forward
pre-hook and frees them in its post-hook: under ``generate`` that is one all-gather per layer
per token. A captured step must do neither (a collective and a free recorded in a graph, and the
root's pre-hook making FSDP's communication streams wait on the capturing stream). So for one
call graphcap unshards every FSDP module (one all-gather each, on every rank, before anything
is captured or replayed), holds FSDP's forward hooks idle, and reshards after the call, so the
trainer gets its memory back. No collective runs inside the call: ranks may decode different
numbers of steps.

FSDP frees the unsharded storage at a reshard and allocates it again, at a new address, at the
next unshard (in place: the same tensors, resized), so the graphs read the engine's own copy
(:mod:`graphcap.rollout.holder.weights`), refilled at each call.

Idle hooks: FSDP has no public switch for them. This module puts each FSDP state in the state
FSDP's own hooks take while activation checkpointing recomputes a forward during backward
(``TrainingState.PRE_BACKWARD``): there the pre-hook only checks that the parameters are
unsharded (they are) and casts inputs per the mixed-precision policy, the post-hook only casts
outputs. That reads three private names of torch (``FSDPModule._get_fsdp_state``,
``_training_state``, ``TrainingState``), pinned by tests/test_sharded_trainers.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from graphcap.rollout.plan.scan import is_fsdp2


@contextlib.contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[None]:
    """Within the block every FSDP2 module of ``model`` is unsharded and FSDP's forward hooks
    neither gather nor free; resharded after. Nothing happens for a model without FSDP2."""
    modules = [module for module in model.modules() if is_fsdp2(module)]
    if not modules:
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    states = list({id(s): s for s in (m._get_fsdp_state() for m in modules)}.values())
    before = [state._training_state for state in states]
    try:
        for module in modules:
            module.unshard()
        for state in states:
            state._training_state = TrainingState.PRE_BACKWARD
        yield
    finally:
        for state, training_state in zip(states, before, strict=True):
            state._training_state = training_state
        for module in modules:
            module.reshard()
