"""Whether a model and request can run on the static graph path, and if not, why.

Refusals come in two kinds. Things graphs cannot serve send the call to the eager loop with the
reason recorded in the stats (a backend without graphs, a stateful model, parameters gathered
inside forward, chunked attention, autocast's weight cache). Things the user explicitly asked
for that graphs cannot do raise :class:`GraphUnsupportedModelError` (an attention
implementation that reads host values per call).
"""

from __future__ import annotations

import torch

from graphcap.backend import Backend
from graphcap.errors import GraphUnsupportedModelError
from graphcap.rollout.masks import unsupported_layer_types
from graphcap.rollout.signature import attention_implementation, autocast_state

#: Attention implementations whose kernels read host values per call (varlen lengths, block
#: tables) or build masks with host logic; a graph would freeze them.
UNSAFE_ATTENTION_MARKERS: tuple[str, ...] = ("flash_attention", "flex_attention", "paged")


def check_attention(model: torch.nn.Module) -> None:
    """Raise if the model's attention implementation is known not to be graph-safe."""
    name = attention_implementation(model)
    if any(marker in name for marker in UNSAFE_ATTENTION_MARKERS):
        raise GraphUnsupportedModelError(
            f"attention implementation {name!r} is not graph-safe (it reads host values per "
            "call); load the model with attn_implementation='sdpa' or 'eager', or set "
            "RolloutConfig(enable_graph_capture=False)"
        )


def non_resident_reason(model: torch.nn.Module) -> str | None:
    """Why the model's parameters are not plain resident tensors, or ``None`` if they are.

    Graph replay reads fixed addresses; parameters gathered in forward hooks (ZeRO-3, FSDP,
    DTensor shards) or zero-size placeholders live at addresses the signature cannot see.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        DTensor = ()  # type: ignore[assignment]
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            return f"parameter {name!r} is a DTensor (sharded; gathered during forward)"
        if hasattr(param, "ds_id") or hasattr(param, "ds_status"):
            return f"parameter {name!r} is managed by DeepSpeed ZeRO-3 (gathered during forward)"
        if param.numel() == 0:
            return f"parameter {name!r} is a zero-size placeholder (not resident)"
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind == "FullyShardedDataParallel" or kind.startswith("FSDP"):
            return f"module {name or '<root>'!r} is FSDP-managed ({kind})"
    return None


def graph_refusal(model: torch.nn.Module, backend: Backend) -> str | None:
    """Why this call must run eagerly although graphs were requested, or ``None``."""
    if not backend.supports_graph_capture:
        return f"backend {backend.name!r} cannot capture graphs (create_graph() returned None)"
    if getattr(model, "_is_stateful", False):
        return f"{type(model).__name__} is stateful (_is_stateful); its state is not in the cache"
    reason = non_resident_reason(model)
    if reason:
        return reason
    unsupported = unsupported_layer_types(getattr(model, "config", None))
    if unsupported:
        return (
            f"layer types {unsupported} need masks beyond full/sliding-window attention; only "
            "full_attention and sliding_attention layers are supported on the graph path"
        )
    enabled, _, cache_enabled = autocast_state(backend.device.type)
    if enabled and cache_enabled:
        return (
            "autocast with its weight cache enabled would freeze cast copies of the weights in "
            "the graph; use torch.autocast(..., cache_enabled=False)"
        )
    return None
