"""Graph-safe attention for transformers on Ascend: two torch_npu kernels, two layouts each.

* ``npu_fusion_attention_v3``: the graph-mode variant of torch_npu's fused attention (v1/v2 run
  part of their work on an internal secondary stream, which breaks ACL graph capture with error
  107025). Documented for Atlas A2 training products; fp16, bf16 and fp32.
* ``npu_fused_infer_attention_score``: the inference kernel (a single-token query takes its
  incremental branch). Documented for Atlas A2 training and Atlas 800I A2 inference products;
  fp16 and bf16 only (no fp32), one mask for all heads.

Each is offered in the BSH layout (heads packed into the last dimension; the layout the original
NPU rollout work captured on hardware) and in BNSD (the layout transformers hands attention
functions, which torch_npu documents ACL-graph support for; no copy of q/k/v). The TND (varlen)
layout is never used: its sequence lengths are host values that a capture would freeze.

``graphcap_npu_blocks`` (the backend's default) reads the engine's block KV table
(:mod:`graphcap.kv_blocks`): a half-precision decode step runs
``npu_fused_infer_attention_score``'s page attention over the layer's pools, with the block
table and per-row ``actual_seq_lengths_kv``, so it reads only the blocks a row holds and copies
no cache. Those lengths are host ints: eager steps read them off the device, a capture records
placeholders that the pool always holds (one column a row: the kernel refuses lengths needing
more blocks than the pool has) and the engine sets the real ones before each replay
(``NPUBackend.update_graph_kv_lengths``, torch_npu's ``NPUGraph.update``). Each pool holds at
most int32-range elements (:func:`check_pool_size` refuses a larger one). What page attention
cannot serve (fp32, which that kernel does not take; a block size that is not a multiple of 16;
per-head masks) gets the pools gathered into contiguous K/V for v3 in BNSD; without a block
table (prefill, ``kv_block_size=None``) it is v3 in BNSD.

Masks: transformers gives SDPA's conventions (bool True = attend, or an additive float mask with
0 = attend); both kernels want bool/uint8 where True = masked out. Everything here is device work
with host values fixed by shapes, so it can be captured and replayed.

Fully masked rows: both kernels lose precision on a query row with nothing to attend to unless
``inner_precise=2`` (invalid-row correction, documented to slow the kernel). Whether such a row
can exist is decided from the shapes, never by reading the mask: a single-token query (a decode
step) always attends at least to the key it has just written (graphcap's decode masks mark that
column valid for every row, idle continuous slots included, which write into a sink column), so
it runs without the correction; a multi-token query with a mask (a left-padded prefill, whose
pad queries attend to nothing) runs with it.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from graphcap import kv_blocks
from graphcap_npu import graph_updates

Kernel = Literal["fusion_v3", "infer_score", "paged"]
Layout = Literal["BSH", "BNSD"]

#: v3 in BSH: the default graph attention of the NPU backend.
FA3_BSH = "graphcap_npu_fa3"
#: v3 in BNSD.
FA3_BNSD = "graphcap_npu_fa3_bnsd"
#: npu_fused_infer_attention_score in BSH (half precision only).
FIAS_BSH = "graphcap_npu_fias"
#: npu_fused_infer_attention_score in BNSD (half precision only).
FIAS_BNSD = "graphcap_npu_fias_bnsd"
#: Page attention over the block KV table (half precision), else v3 in BNSD: the default.
BLOCKS = "graphcap_npu_blocks"
#: The name ``register_attention()`` registers without an argument (the first release's).
ATTENTION_NAME = FA3_BSH
#: Page attention's block size: a multiple of 16 for fp16/bf16 (torch_npu recommends 128).
PAGE_ALIGNMENT = 16
#: ``inner_precise`` value that makes the kernels compute fully masked ("invalid") rows properly.
INNER_PRECISE_INVALID_ROWS = 2
#: The length a capture records for every row (see ``_attend_paged``).
PLACEHOLDER_LENGTH = 1
#: Page attention takes K and V pools of at most this many elements each (int32 range).
MAX_POOL_ELEMENTS = 2**31 - 1
_MAX_QUERY_HEADS = 256
_MAX_HEAD_DIM = 768


@dataclass(frozen=True)
class Implementation:
    """One registered attention name: which kernel, in which layout, for which dtypes."""

    name: str
    kernel: Kernel
    layout: Layout

    @property
    def torch_npu_function(self) -> str:
        return {
            "fusion_v3": "npu_fusion_attention_v3",
            "infer_score": "npu_fused_infer_attention_score",
            "paged": "npu_fused_infer_attention_score",
        }[self.kernel]

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes it runs (the paged one: every dtype, fp32 through v3 on gathered K/V)."""
        if self.kernel == "infer_score":
            return (torch.float16, torch.bfloat16)
        return (torch.float16, torch.bfloat16, torch.float32)


IMPLEMENTATIONS: dict[str, Implementation] = {
    impl.name: impl
    for impl in (
        Implementation(FA3_BSH, "fusion_v3", "BSH"),
        Implementation(FA3_BNSD, "fusion_v3", "BNSD"),
        Implementation(FIAS_BSH, "infer_score", "BSH"),
        Implementation(FIAS_BNSD, "infer_score", "BNSD"),
        Implementation(BLOCKS, "paged", "BNSD"),
    )
}


AttentionFunction = Callable[..., tuple[torch.Tensor, None]]


def _forward_for(name: str) -> AttentionFunction:
    """The transformers ``AttentionInterface`` function of implementation ``name``."""
    impl = IMPLEMENTATIONS[name]

    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        return _attend(impl, module, query, key, value, attention_mask, scaling, dropout, kwargs)

    forward.__name__ = forward.__qualname__ = f"{name.removeprefix('graphcap_npu_')}_forward"
    forward.__doc__ = (
        f"``{impl.torch_npu_function}`` in the {impl.layout} layout, as a transformers attention "
        "function: q/k/v (batch, heads, seq, head_dim) in, (batch, seq, heads, head_dim) out."
    )
    return forward


@kv_blocks.reads_kv_blocks
def block_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Page attention over the block table where it applies, else v3 in BNSD (module docstring):
    q (batch, heads, seq, head_dim) and, under a block view, the layer's pools
    (num_blocks, kv_heads, block_size, head_dim) in; (batch, seq, heads, head_dim) out."""
    view = kv_blocks.current()
    if view is not None and _pages(view, query, attention_mask, dropout, kwargs):
        return _attend_paged(query, key, value, attention_mask, scaling, view)
    if view is not None:
        key, value = kv_blocks.gather(key, view), kv_blocks.gather(value, view)
    impl = IMPLEMENTATIONS[FA3_BNSD]
    return _attend(impl, module, query, key, value, attention_mask, scaling, dropout, kwargs)


def _pages(
    view: kv_blocks.BlockView,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> bool:
    """Whether page attention serves this call: a one-token query in half precision, one mask
    for every head, a block size the kernel takes, nothing it does not model."""
    return (
        query.shape[2] == 1
        and query.dtype in IMPLEMENTATIONS[FIAS_BNSD].dtypes
        and view.block_size % PAGE_ALIGNMENT == 0
        and (attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] == 1)
        and not dropout
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
    )


def _attend_paged(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    view: kv_blocks.BlockView,
) -> tuple[torch.Tensor, None]:
    """``npu_fused_infer_attention_score`` with ``block_table`` over pools (num_blocks, KV_N,
    block_size, D): torch_npu's faster page-attention cache layout, graphcap's pool layout."""
    batch, q_heads, _, head_dim = query.shape
    if q_heads % key.shape[1] or key.shape[-1] != head_dim or key.shape != value.shape:
        raise ValueError(
            f"page attention needs pools (num_blocks, kv_heads, block_size, {head_dim}) of one "
            f"shape with kv_heads dividing {q_heads}; got {tuple(key.shape)}, "
            f"{tuple(value.shape)}"
        )
    masked_out = None
    if attention_mask is not None:
        masked_out = to_masked_out(attention_mask, batch, q_heads, 1, view.max_len)
        masked_out = _one_mask_for_all_heads(masked_out, batch, 1, view.max_len)
    check_pool_size(key)
    module_npu = _torch_npu(IMPLEMENTATIONS[BLOCKS])
    if module_npu.npu.is_current_stream_capturing():
        # placeholders the pool always holds (one block a row; the rows' whole tables need not
        # fit it, and the kernel refuses lengths that need more blocks than the pool has); the
        # engine sets the real lengths before every replay, through the graph-update API
        lengths = [PLACEHOLDER_LENGTH] * batch
    else:
        lengths = view.lengths.tolist()  # a host read: eager steps only
    query = query.contiguous()
    with graph_updates.updatable():  # the one call each replay's update re-issues
        out, _ = module_npu.npu_fused_infer_attention_score(
            query,
            key,
            value,
            atten_mask=masked_out,
            actual_seq_lengths_kv=lengths,
            block_table=view.table,
            block_size=view.block_size,
            num_heads=q_heads,
            num_key_value_heads=key.shape[1],
            input_layout="BNSD",
            scale=scaling if scaling is not None else 1.0 / math.sqrt(head_dim),
            inner_precise=0,  # a decode row always attends to the column it has just written
        )
    return out.transpose(1, 2).contiguous(), None


def check_pool_size(pool: torch.Tensor) -> None:
    """Refuse a K/V pool page attention cannot address: its elements must stay in int32
    range (with 8 K/V heads of 128 and 128-column blocks, 16,383 blocks)."""
    if pool.numel() > MAX_POOL_ELEMENTS:
        blocks, heads, block_size, head_dim = pool.shape
        most = MAX_POOL_ELEMENTS // (heads * block_size * head_dim)
        raise ValueError(
            f"the K/V pool grew to {blocks} blocks of {heads} x {block_size} x {head_dim} "
            f"({pool.numel():,} elements), beyond the int32 range npu_fused_infer_attention_score "
            f"addresses (at most {most} such blocks); generate fewer rows per call (a smaller "
            "batch or continuous_batch_size) or fewer new tokens"
        )


#: The registered functions, by name.
FORWARDS: dict[str, AttentionFunction] = {
    name: _forward_for(name) for name in IMPLEMENTATIONS if name != BLOCKS
}
FORWARDS[BLOCKS] = block_attention_forward
fusion_attention_forward = FORWARDS[FA3_BSH]
fusion_attention_bnsd_forward = FORWARDS[FA3_BNSD]
infer_attention_forward = FORWARDS[FIAS_BSH]
infer_attention_bnsd_forward = FORWARDS[FIAS_BNSD]


def _attend(
    impl: Implementation,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """q/k/v arrive as (batch, heads, seq, head_dim); the output is (batch, seq, heads, head_dim).
    Key/value may have fewer heads than the query (grouped-query attention is native)."""
    _check_inputs(impl, query, key, value, dropout, kwargs)
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    is_causal = kwargs.get("is_causal")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    inner_precise = 0
    if attention_mask is not None:
        masked_out = to_masked_out(attention_mask, batch, q_heads, q_len, kv_len)
        if impl.kernel == "infer_score":
            masked_out = _one_mask_for_all_heads(masked_out, batch, q_len, kv_len)
        # Shapes decide, never a host read (see the module docstring): a multi-token query
        # with a mask may hold pad rows with nothing to attend to; a single-token one may not.
        if q_len > 1:
            inner_precise = INNER_PRECISE_INVALID_ROWS
    elif is_causal and q_len > 1:
        # SDPA's is_causal (top-left aligned), which transformers relies on when it skips the mask.
        masked_out = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).triu_(1)
    else:
        masked_out = None
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    q, k, v = (_to_layout(t, impl.layout) for t in (query, key, value))
    kernel = getattr(_torch_npu(impl), impl.torch_npu_function)
    if impl.kernel == "fusion_v3":
        outputs = kernel(
            q,
            k,
            v,
            q_heads,
            input_layout=impl.layout,
            atten_mask=masked_out,
            scale=scale,
            keep_prob=1.0,
            inner_precise=inner_precise,
        )
    else:
        outputs = kernel(
            q,
            k,
            v,
            atten_mask=masked_out,
            num_heads=q_heads,
            num_key_value_heads=kv_heads,
            input_layout=impl.layout,
            scale=scale,
            inner_precise=inner_precise,
        )
    out = outputs[0]
    if impl.layout == "BSH":
        return out.view(batch, q_len, q_heads, head_dim), None
    return out.transpose(1, 2).contiguous(), None


def _to_layout(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(B, N, S, D) as the kernel reads it: plain BNSD memory, or BSH (B, S, N * D)."""
    if layout == "BNSD":
        return tensor.contiguous()
    batch, heads, seq, dim = tensor.shape
    return tensor.transpose(1, 2).reshape(batch, seq, heads * dim).contiguous()


def to_masked_out(
    attention_mask: torch.Tensor, batch: int, heads: int, q_len: int, kv_len: int
) -> torch.Tensor:
    """An SDPA-convention mask as the kernel's boolean "True = masked out" mask.

    Accepts bool (True = attend) or floating additive (0 = attend, negative = masked) masks of
    shape (q, kv) or 4-D broadcastable to (batch, heads, q, kv). The result has one of the shapes
    ``npu_fusion_attention_v3`` takes (SS, 11SS, B1SS, BNSS) and is contiguous.
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


def _one_mask_for_all_heads(
    masked_out: torch.Tensor, batch: int, q_len: int, kv_len: int
) -> torch.Tensor:
    """The mask shapes ``npu_fused_infer_attention_score`` takes: one mask for every head,
    (B, 1, 1, KV) for a single-token query, (B or 1, 1, Q, KV) otherwise."""
    if masked_out.dim() == 4 and masked_out.shape[1] != 1:
        raise ValueError(
            "npu_fused_infer_attention_score takes one mask for all heads, not a per-head mask "
            f"of shape {tuple(masked_out.shape)}; use {FA3_BSH!r} for per-head masks"
        )
    if masked_out.dim() == 2:
        masked_out = masked_out[None, None]
    if q_len == 1 and masked_out.shape[0] != batch:
        masked_out = masked_out.expand(batch, 1, 1, kv_len).contiguous()
    return masked_out


def _check_inputs(
    impl: Implementation,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    kwargs: dict[str, Any],
) -> None:
    kernel = impl.torch_npu_function
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "query, key and value must be 4-D (batch, heads, seq, head_dim); got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape != value.shape:
        raise ValueError(
            f"{kernel} needs key and value of one shape; got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
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
    if query.dtype not in impl.dtypes or not query.dtype == key.dtype == value.dtype:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in impl.dtypes)
        hint = f"; use {FA3_BSH!r} for float32 models" if impl.kernel == "infer_score" else ""
        raise TypeError(
            f"{kernel} ({impl.name}) needs query, key and value of one dtype among {allowed}; "
            f"got {query.dtype}, {key.dtype}, {value.dtype}{hint}"
        )
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} is not supported by {impl.name} (built for rollouts); "
            "call model.eval() or use another attention implementation for training"
        )
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(
                f"{impl.name} does not support {unsupported!r} (logit soft-capping or attention "
                "sinks); use the model's eager attention instead"
            )


def _torch_npu(impl: Implementation) -> Any:
    module = importlib.import_module("torch_npu")
    if not hasattr(module, impl.torch_npu_function):
        raise RuntimeError(
            f"this torch_npu has no {impl.torch_npu_function} (needed by {impl.name}); install "
            "a torch_npu release that provides it (2.14.0 does)"
        )
    return module


def register_attention(name: str = ATTENTION_NAME) -> str:
    """Register implementation ``name`` and its mask function with transformers; returns it.

    Both are needed: for an attention name with no mask function transformers builds no mask at
    all (``create_causal_mask`` returns None), so padding and causality would silently vanish.
    The mask function is transformers' ``sdpa_mask`` (bool, True = attend), converted per call.
    Then load or configure the model with ``attn_implementation=name``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if name not in FORWARDS:
        raise ValueError(
            f"unknown graphcap_npu attention {name!r}; choose one of {', '.join(FORWARDS)}"
        )
    AttentionInterface.register(name, FORWARDS[name])
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
