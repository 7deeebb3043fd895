"""One pass over the model per call: the facts the input checks, the plan and the signature read.

Each of them used to walk the module tree or the parameters on its own (device placement,
residency, sharding, dtype, tensor facts, training flags, host state): ten walks, a large part
of a small model's host time per call (docs/decisions.md, decision 26). :func:`scan_model`
walks the modules once and the parameters and buffers once.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from graphcap.rollout.plan.fingerprint import HostState, hook_name, host_state

#: What :attr:`ModelScan.sharded` names.
FSDP2 = "FSDP2"
ZERO3 = "DeepSpeed ZeRO-3"

TensorFacts = tuple[str, int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


@dataclass(frozen=True)
class ModelScan:
    """What one call reads from the model.

    ``tensors``: name, address, shape, strides, dtype and device of every parameter and buffer
    (a sharded ``DTensor`` through its local shard: the memory the step reads). ``dtype``: the
    floating dtype attention computes in (masks are built in it). ``mesh``: the device mesh of
    the first ``DTensor`` parameter, if any. ``non_resident``: why parameters are not resident
    on this rank (gathered inside forward), or ``None``. ``sharded``: the library whose
    sharding gives the parameters new storage every round (:data:`FSDP2`: graphcap unshards
    them around the call; :data:`ZERO3`: the trainer gathers them), or ``None``.
    """

    tensors: tuple[TensorFacts, ...]
    training: tuple[bool, ...]
    host_state: HostState
    dtype: torch.dtype
    mesh: Any | None
    non_resident: str | None
    sharded: str | None

    def misplaced(self, device: torch.device) -> list[tuple[str, torch.device]]:
        """(name, device) of every tensor that is not on ``device``."""
        return [(name, where) for name, *_, where in self.tensors if where != device]


def scan_model(model: torch.nn.Module) -> ModelScan:
    """The :class:`ModelScan` of ``model`` as it is now."""
    modules = list(model.named_modules(remove_duplicate=False))
    parameters = list(model.named_parameters(remove_duplicate=False))
    named = parameters + list(model.named_buffers(remove_duplicate=False))
    mesh = next((p.device_mesh for _, p in parameters if is_dtensor(p)), None)
    return ModelScan(
        tensors=tuple(_facts(name, local_shard(t)) for name, t in named),
        training=tuple(m.training for _, m in modules),
        host_state=host_state(model, modules),
        dtype=_attention_dtype(model, [p for _, p in parameters]),
        mesh=mesh,
        non_resident=_non_resident(modules, parameters),
        sharded=_sharded(modules, parameters),
    )


def _facts(name: str, t: torch.Tensor) -> TensorFacts:
    return (name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def loaded_class(module: str, name: str) -> type | None:
    """Class ``name`` of ``module`` where something imported that module, else ``None``: no
    object is an instance of a class whose module nobody imported, so a model sharded with
    ``DTensor`` or FSDP2 has them loaded, and graphcap does not import them itself (they cost
    over half a second of ``import graphcap.rollout``; docs/architecture.md, "Import time")."""
    loaded = sys.modules.get(module)
    return None if loaded is None else getattr(loaded, name, None)


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (sharded or replicated over a device mesh)."""
    dtensor = loaded_class("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(tensor, dtensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own part of ``tensor``: the local shard of a ``DTensor``, else itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _attention_dtype(model: torch.nn.Module, parameters: list[torch.Tensor]) -> torch.dtype:
    """That of the first floating parameter outside the token and output embeddings (which may
    be kept in another dtype than the layers); float32 if the model has none."""
    embeddings: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, None)
        module = module() if callable(module) else None
        if isinstance(module, torch.nn.Module):
            embeddings.update(id(p) for p in module.parameters())
    floating = [p for p in parameters if p.is_floating_point()]
    inner = [p for p in floating if id(p) not in embeddings]
    return (inner or floating)[0].dtype if floating else torch.float32


def is_fsdp2(module: torch.nn.Module) -> bool:
    """Whether ``module`` is managed by FSDP2 (``torch.distributed.fsdp.fully_shard``)."""
    fsdp_module = loaded_class("torch.distributed.fsdp", "FSDPModule")
    return fsdp_module is not None and isinstance(module, fsdp_module)


def _sharded(
    modules: list[tuple[str, torch.nn.Module]], parameters: list[tuple[str, torch.Tensor]]
) -> str | None:
    if any(is_fsdp2(module) for _, module in modules):
        return FSDP2
    if any(hasattr(param, "ds_id") for _, param in parameters):
        return ZERO3
    return None


def _non_resident(
    modules: list[tuple[str, torch.nn.Module]], parameters: list[tuple[str, torch.Tensor]]
) -> str | None:
    """Graph replay reads fixed addresses; parameters gathered in forward hooks (ZeRO-3 without
    a gather around the call, FSDP1) or zero-size placeholders live at addresses the signature
    cannot see. Tensor-parallel shards (``DTensor`` parameters outside FSDP) are resident: the
    step reads the local shard. So are FSDP2's (graphcap unshards them around the call,
    :mod:`graphcap.rollout.holder.fsdp`) and ZeRO-3 parameters gathered around the call
    (TRL's ``ds3_gather_for_generation``, which also removes ZeRO-3's hooks)."""
    for name, module in modules:
        kind = type(module).__name__
        if is_fsdp2(module):
            continue
        if kind == "FullyShardedDataParallel" or kind.startswith("FSDP"):
            return f"module {name or '<root>'!r} is FSDP-managed ({kind}; gathered during forward)"
        hook = _zero3_hook(module)
        if hook is not None:
            return (
                f"module {name or '<root>'!r} runs DeepSpeed ZeRO-3's forward hook {hook} (it "
                "gathers and releases parameters inside forward): gather the parameters around "
                "generate and remove the hooks, as TRL's ds3_gather_for_generation=True does"
            )
    for name, param in parameters:
        status = getattr(getattr(param, "ds_status", None), "name", "AVAILABLE")
        if hasattr(param, "ds_id") and (param.numel() == 0 or status != "AVAILABLE"):
            return (
                f"parameter {name!r} is a DeepSpeed ZeRO-3 partition ({status}; gathered during "
                "forward): gather the parameters around generate, as TRL's "
                "ds3_gather_for_generation=True does"
            )
        if param.numel() == 0:
            return f"parameter {name!r} is a zero-size placeholder (not resident)"
    return None


def _zero3_hook(module: torch.nn.Module) -> str | None:
    """The qualified name of a forward hook DeepSpeed installed on ``module``, or ``None``."""
    state = vars(module)
    for hooks in (state.get("_forward_pre_hooks", {}), state.get("_forward_hooks", {})):
        for hook in hooks.values():
            where, name = hook_name(hook)
            if where.split(".")[0] == "deepspeed":
                return f"{where}.{name}"
    return None
