"""Graph-safe decode attention that reads grouped-query K/V as it is (no repeat per head).

transformers' SDPA integration repeats K/V to every query head whenever a mask is given (its
``use_gqa_in_sdpa`` allows ``enable_gqa`` only without a mask), and the captured decode step
always passes a 4-D mask: at RL batch sizes that copy of the whole cache, every layer and every
step, dominates the step. This function hands the unrepeated K/V to
``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` together with the mask.

Everything else follows transformers' SDPA path, so the results are SDPA's: the mask the engine
passes already encodes padding and sliding windows; a multi-token query without a mask (prefill)
is causal. What SDPA cannot express is computed exactly instead: attention-logit soft-capping
(Gemma 2) by the eager formula on grouped heads, a position bias by transformers' own SDPA
function. Attention sinks are refused with a clear error. Host values come from shapes only, so
the function captures and replays; it runs on any device SDPA runs on (CPU included).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from graphcap import kv_blocks

#: Names under which the CUDA plugin offers the functions (``graphcap_attention_implementations``).
GQA_SDPA = "graphcap_gqa_sdpa"
SPLIT_KV = "graphcap_split_kv"


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function: q/k/v (batch, heads, seq, head_dim) in,
    (batch, seq, heads, head_dim) out, plus ``None`` for the attention weights.

    ``key`` / ``value`` may have fewer heads than ``query`` (a whole fraction of them).
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            f"{GQA_SDPA} does not implement attention sinks (s_aux); use the model's own "
            "attention: RolloutConfig(graph_attention=None)"
        )
    if kwargs.get("position_bias") is not None:  # encoder-style bias: transformers' own path
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(
            f"{GQA_SDPA}: {heads} query heads are not a multiple of {kv_heads} key/value heads"
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and kv_len > q_len:  # SDPA's causal mask is top-left aligned: later keys unseen
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if not module.training:
        dropout = 0.0
    if softcap and dropout:
        raise NotImplementedError(
            f"{GQA_SDPA}: soft-capped attention with dropout (training) is not implemented; "
            "use the model's own attention for training forwards"
        )
    if softcap:
        out = softcapped_attention(query, key, value, attention_mask, scaling, softcap, causal)
    else:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=causal,
            enable_gqa=heads != kv_heads,
        )
    return out.transpose(1, 2).contiguous(), None


@kv_blocks.reads_kv_blocks
def split_kv_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function for captured decode steps: a one-token query
    with the engine's (batch, 1, 1, L) mask runs the split-KV Triton kernel
    (:mod:`graphcap_cuda.kernels.split_kv`), which reads only the cache blocks the mask opens;
    anything else (prefill, no mask, per-head masks, sinks, position bias, dropout) is
    :func:`gqa_sdpa_forward`'s.

    Block-aware (:mod:`graphcap.kv_blocks`): while a block view is current, ``key`` / ``value``
    are the layer's pools; a decode step reads them through the table
    (``split_kv_decode_paged``), anything else gets them gathered into contiguous K/V first.
    """
    view = kv_blocks.current()
    decode = (
        query.shape[2] == 1
        and attention_mask is not None
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == attention_mask.shape[2] == 1
        and kwargs.get("s_aux") is None
        and kwargs.get("position_bias") is None
        and not (dropout and module.training)
        and query.shape[1] % key.shape[1] == 0
    )
    if not decode:
        if view is not None:  # not a shape the paged kernel serves: contiguous K/V for SDPA
            key, value = kv_blocks.gather(key, view), kv_blocks.gather(value, view)
        return gqa_sdpa_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout,
            scaling,
            is_causal,
            softcap,
            **kwargs,
        )
    from graphcap_cuda.kernels.split_kv import split_kv_decode, split_kv_decode_paged

    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    tensors = (_unit_stride(query[:, :, 0]), _unit_stride(key), _unit_stride(value))
    if view is None:
        mask = _unit_stride(attention_mask[:, 0, 0, : key.shape[2]])
        out = split_kv_decode(*tensors, mask, scale, softcap or 0.0)
    else:
        mask = _unit_stride(attention_mask[:, 0, 0, : view.max_len])
        table, lengths = view.table, view.lengths
        out = split_kv_decode_paged(*tensors, mask, table, lengths, scale, softcap or 0.0)
    return out.unsqueeze(1), None


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dimension densely (cache tensors and masks already are)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def softcapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    softcap: float,
    causal: bool,
) -> torch.Tensor:
    """transformers' eager soft-capped attention, with query heads grouped over their shared
    K/V head instead of K/V repeated: ``softmax(tanh(q k^T s / c) c + mask) v``, the softmax in
    fp32 as transformers computes it. Returns (batch, heads, q_len, head_dim)."""
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    grouped = query.reshape(batch, kv_heads, groups * q_len, dim)
    scores = torch.matmul(grouped, key.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(batch, kv_heads, groups, q_len, kv_len)
    mask = attention_mask
    if mask is None and causal:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril_()
    if mask is not None:
        if mask.dim() == 4:  # (batch, heads or 1, q, kv): heads split into (kv_heads, groups)
            rows, mask_heads, mask_q, mask_kv = mask.shape
            if mask_heads == 1:
                mask = mask.unsqueeze(2)
            else:
                mask = mask.reshape(rows, kv_heads, groups, mask_q, mask_kv)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = weights.view(batch, kv_heads, groups * q_len, kv_len)
    out = torch.matmul(weights, value)
    return out.view(batch, heads, q_len, dim)


def register_attention(name: str = GQA_SDPA) -> str:
    """Register the function offered as ``name`` (:data:`GQA_SDPA` or :data:`SPLIT_KV`) and
    transformers' SDPA mask function under that name; returns it.

    The engine does this through the plugin hook; call it directly to load a model with
    ``attn_implementation=name``. (Without a mask function transformers builds no mask at all.)
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, IMPLEMENTATIONS[name])
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


#: Every attention function the plugin offers, by name: the split-KV kernel only where Triton is
#: installed (CUDA builds of torch ship it).
IMPLEMENTATIONS = {GQA_SDPA: gqa_sdpa_forward}
if importlib.util.find_spec("triton") is not None:
    IMPLEMENTATIONS[SPLIT_KV] = split_kv_forward
#: What captured steps run by default: the split-KV kernel where it is offered.
DEFAULT_ATTENTION = SPLIT_KV if SPLIT_KV in IMPLEMENTATIONS else GQA_SDPA
