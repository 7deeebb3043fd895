"""Graph-safe attention for transformers on Ascend: ``npu_fusion_attention_v3`` in BNSD layout.

Why this kernel and layout: v1/v2 of torch_npu's fused attention run part of their work on an
internal secondary stream, which breaks ACL graph capture (error 107025); v3 is the graph-mode
variant. The TND (varlen) layout is never used: its sequence lengths are host tensors that a
capture would freeze. BNSD is the layout transformers already hands attention functions, so q/k/v
go to the kernel without a copy, and :class:`~graphcap_npu.kv_table.GrowableKVTable` keeps its
buffers in it.

Masks: transformers gives SDPA's conventions (bool True = attend, or an additive float mask with
0 = attend); the kernel wants bool/uint8 where True = masked out. Everything here is device work
with host values fixed by shapes, so it can be captured and replayed.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch

#: Name under which the function is registered with transformers' AttentionInterface.
ATTENTION_NAME = "graphcap_npu_fa3"
#: ``inner_precise`` value that makes the kernel compute fully masked ("invalid") rows properly.
INNER_PRECISE_INVALID_ROWS = 2
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_QUERY_HEADS = 256
_MAX_HEAD_DIM = 768


def fusion_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function running ``npu_fusion_attention_v3``.

    q/k/v arrive as (batch, heads, seq, head_dim); the output is (batch, seq, heads, head_dim).
    Key/value may have fewer heads than the query (grouped-query attention is native).
    """
    _check_inputs(query, key, value, dropout, kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    is_causal = kwargs.get("is_causal")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None:
        masked_out = to_masked_out(attention_mask, query.shape[0], query.shape[1], q_len, kv_len)
        # A mask may hold rows with nothing to attend to (inactive slots, all-pad prompt rows);
        # finding out would need a host read, which a graph cannot have. Such rows lose precision
        # unless the kernel's invalid-row handling is on, so it is on whenever a mask is given.
        inner_precise = INNER_PRECISE_INVALID_ROWS
    elif is_causal and q_len > 1:
        # SDPA's is_causal (top-left aligned), which transformers relies on when it skips the mask.
        masked_out = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).triu_(1)
        inner_precise = 0  # every row attends at least to its first key
    else:
        masked_out, inner_precise = None, 0
    # The kernel reads its inputs as plain BNSD memory; transformers' q/k/v are transposed views
    # (a KV-table buffer is already contiguous, so this costs nothing there).
    outputs = _torch_npu().npu_fusion_attention_v3(
        query.contiguous(),
        key.contiguous(),
        value.contiguous(),
        query.shape[1],
        input_layout="BNSD",
        atten_mask=masked_out,
        scale=scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1]),
        keep_prob=1.0,
        inner_precise=inner_precise,
    )
    return outputs[0].transpose(1, 2).contiguous(), None


def to_masked_out(
    attention_mask: torch.Tensor, batch: int, heads: int, q_len: int, kv_len: int
) -> torch.Tensor:
    """An SDPA-convention mask as the kernel's boolean "True = masked out" mask.

    Accepts bool (True = attend) or floating additive (0 = attend, negative = masked) masks of
    shape (q, kv) or 4-D broadcastable to (batch, heads, q, kv). The result has one of the shapes
    the kernel takes (SS, 11SS, B1SS, BNSS) and is contiguous.
    """
    if attention_mask.dtype == torch.bool:
        masked_out = attention_mask.logical_not()
    elif attention_mask.is_floating_point():
        # Only a 0 / large-negative mask survives the trip to bool; a learned bias (ALiBi and
        # similar) would be flattened to "masked" and must go through the kernel's pse instead.
        masked_out = attention_mask != 0
    else:
        raise TypeError(
            f"attention mask of dtype {attention_mask.dtype} is ambiguous; pass a bool mask "
            "(True = attend) or an additive float mask (0 = attend, -inf or dtype min = masked)"
        )
    if masked_out.dim() == 2:
        if tuple(masked_out.shape) != (q_len, kv_len):
            raise ValueError(
                f"a 2-D attention mask must be (q_len, kv_len) = ({q_len}, {kv_len}); got "
                f"{tuple(attention_mask.shape)}. Its last dimension must equal the key length."
            )
        return masked_out.contiguous()
    if masked_out.dim() != 4:
        raise ValueError(
            f"attention mask must be 2-D (q, kv) or 4-D (batch, heads, q, kv); got shape "
            f"{tuple(attention_mask.shape)}"
        )
    mask_batch, mask_heads, mask_q, mask_kv = masked_out.shape
    if (
        mask_kv != kv_len
        or mask_q not in (1, q_len)
        or mask_batch not in (1, batch)
        or mask_heads not in (1, heads)
    ):
        raise ValueError(
            f"attention mask of shape {tuple(attention_mask.shape)} does not broadcast to "
            f"(batch, heads, q_len, kv_len) = ({batch}, {heads}, {q_len}, {kv_len}): batch and "
            "heads must be 1 or the full size, q_len 1 or the full size, and kv_len must equal "
            "the key length (the cache length)"
        )
    # The kernel takes (S, S), (1, 1, S, S), (B, 1, S, S) and (B, N, S, S) only: broadcast a
    # (1, N, ...) mask over the batch and a single query row over all queries.
    target_batch = mask_batch if mask_heads == 1 else batch
    return masked_out.expand(target_batch, mask_heads, q_len, kv_len).contiguous()


def _check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    kwargs: dict[str, Any],
) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "query, key and value must be 4-D (batch, heads, seq, head_dim); got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape != value.shape:
        raise ValueError(
            f"npu_fusion_attention_v3 needs key and value of one shape; got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    if query.shape[0] != key.shape[0] or query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} must agree on batch and "
            "head_dim"
        )
    if not 1 <= query.shape[-1] <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {query.shape[-1]} is outside the kernel's 1..{_MAX_HEAD_DIM}")
    q_heads, kv_heads = query.shape[1], key.shape[1]
    if not 1 <= q_heads <= _MAX_QUERY_HEADS:
        raise ValueError(f"{q_heads} query heads is outside the kernel's 1..{_MAX_QUERY_HEADS}")
    if q_heads % kv_heads != 0:
        raise ValueError(
            f"grouped-query attention needs the query heads ({q_heads}) to be a whole multiple "
            f"of the key/value heads ({kv_heads})"
        )
    if query.dtype not in _SUPPORTED_DTYPES or not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            "npu_fusion_attention_v3 needs query, key and value of one dtype among float16, "
            f"bfloat16, float32; got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} is not supported by {ATTENTION_NAME} (built for "
            "rollouts); call model.eval() or use another attention implementation for training"
        )
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(
                f"{ATTENTION_NAME} does not support {unsupported!r} (logit soft-capping or "
                "attention sinks); use the model's eager attention instead"
            )


def _torch_npu() -> Any:
    module = importlib.import_module("torch_npu")
    if not hasattr(module, "npu_fusion_attention_v3"):
        raise RuntimeError(
            "this torch_npu has no npu_fusion_attention_v3 (the graph-mode fused attention); "
            "install a torch_npu release that provides it (2.14.0 does)"
        )
    return module


def register_attention(name: str = ATTENTION_NAME) -> str:
    """Register the function and its mask function with transformers; returns ``name``.

    Both are needed: for an attention name with no mask function transformers builds no mask at
    all (``create_causal_mask`` returns None), so padding and causality would silently vanish.
    The mask function is transformers' ``sdpa_mask`` (bool, True = attend), converted per call.
    Then load or configure the model with ``attn_implementation=name``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fusion_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
