"""Trainer-exact forwards: a token's log-prob is the same bits in the rollout and the trainer.

An RL trainer recomputes the rollout's log-probs with a full-sequence forward. The decode step,
the prefill and that forward reduce over the same numbers in different orders (the number of
rows picks the matrix product's kernel; the attention's split over keys follows the cache's
length and padding), so the two disagree in the last bits and training is slightly off-policy.
:func:`trainer_exact` makes every reduction of the forward run in an order fixed by the row and
by the key's position alone (docs/decisions.md, decision 85):

- every ``nn.Linear`` (q/k/v/o, the MLP, ``lm_head``) multiplies its rows in tiles of
  :data:`ROW_TILE` rows, zero-padded: each row goes through the same fixed-shape product
  whatever the number of rows (:func:`tiled_linear`);
- attention is :func:`exact_attention`, registered as :data:`EXACT_ATTENTION`: each query's dot
  products, softmax denominator and weighted sum of values are running sums over the key
  columns in position order, in double precision, with exact zeros for masked keys, so left
  padding, a cache's unused columns and the batch add nothing;
- SiLU as ``x / (1 + exp(-x))`` (torch's own SiLU rounds the tail of a vectorised loop
  differently from its body, so a value depended on where it sat in the tensor);
- position ids counted over the real tokens, as ``generate`` counts them, where the trainer
  passes none;
- a layer's gradient-checkpointing function (transformers' ``_gradient_checkpointing_func``),
  so the layer's recomputation in backward, after the block, runs under the context again.

RMSNorm, RoPE and ``log_softmax`` are the model's own: measured row-invariant on the CPU
(decision 85). The engine runs its calls under the same context (``RolloutConfig.trainer_exact``)
and the trainer computes its log-probs with :func:`token_logprobs`. CPU reference only: the
functions are differentiable torch operations, no device kernel is written yet (docs/trainers.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from graphcap.rollout.cache.swap import attributes_swapped

#: The attention implementation name trainer-exact forwards run under.
EXACT_ATTENTION = "graphcap_exact"
#: Model types whose every layer :func:`trainer_exact` covers (decoder layers of RMSNorm, RoPE,
#: linear projections, SiLU MLP, full or sliding-window attention).
EXACT_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
#: Rows per product tile: every linear layer multiplies ``ROW_TILE`` rows at a time.
ROW_TILE = 16


def exact_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run trainer-exact, or ``None`` when it can."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in EXACT_FAMILIES:
        return (
            f"trainer-exact forwards cover the {', '.join(EXACT_FAMILIES)} families; this model "
            f"is {family!r}, whose layers they do not cover (serving it would break the "
            "bit-for-bit promise without a word): use the default mode"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"trainer-exact forwards cover SiLU MLPs; this model's is {config.hidden_act!r}"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout draws random masks; trainer-exact needs attention_dropout=0"
    if not hasattr(model, "set_attn_implementation"):
        return "trainer-exact needs a transformers model (set_attn_implementation)"
    return None


def check_exact_model(model: torch.nn.Module, asked_by: str = "trainer_exact") -> None:
    """Refuse a model trainer-exact forwards do not cover, with the reason and what asked for
    them (``asked_by``: the setting or function to change)."""
    reason = exact_refusal(model)
    if reason is not None:
        raise ValueError(f"{asked_by}: {reason}")


def check_exact_backend(device_type: str) -> None:
    """Refuse a device: the orders these functions rely on (torch's sequential CPU ``cumsum``,
    the CPU BLAS per tile shape) are measured on the CPU only, and no device kernel exists."""
    if device_type != "cpu":
        raise ValueError(
            f"trainer_exact=True is built for the CPU reference backend only; on "
            f"{device_type!r} no trainer-exact kernels exist yet and the CPU reference's "
            "reduction orders are not guaranteed there: use the default mode"
        )


def tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` whose every row goes through one ``(ROW_TILE, K)`` product, zero-padded.

    A BLAS picks its kernel (and so the order of the sum over K) from the number of rows: on
    the CPU a one-row fp32 product differs from a many-row one in the last bit. A fixed tile
    shape fixes the kernel; a row's result does not depend on the other rows of its tile. The
    bias is added after the product, elementwise."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    pad = -count % ROW_TILE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[-1])])
    out = torch.cat([F.linear(tile, weight) for tile in rows.split(ROW_TILE)])[:count]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def exact_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU from operations that round the same wherever an element sits in the tensor."""
    return x / (1 + torch.exp(-x))


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over ``dim`` in index order, accumulated in double: the last element of torch's
    CPU cumulative sum, a sequential loop per output (decision 85). Exact zeros anywhere in the
    dimension leave the result unchanged, so padding columns cost nothing but time."""
    return x.cumsum(dim).select(dim, -1)


def attended_keys(
    attention_mask: torch.Tensor | None, queries: int, keys: int, device: torch.device
) -> torch.Tensor:
    """Which key columns each query attends, as a bool tensor broadcastable to
    ``(B, H, queries, keys)``: the 4-D mask the model was given (bool, or additive with 0 for
    attended), or causal when it was given none."""
    if attention_mask is None:
        query_columns = torch.arange(keys - queries, keys, device=device)
        return torch.arange(keys, device=device)[None, :] <= query_columns[:, None]
    mask = attention_mask[..., -queries:, :keys]
    return mask if mask.dtype == torch.bool else mask == 0


def exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention whose every sum runs over the key columns in order, in float32 products and
    double running sums (:func:`ordered_sum`), masked keys adding exact zeros.

    Keys are in position order in a trainer's batch and in the rollout's cache alike (padding
    and unused columns are masked), so a query's result depends on its own keys only, not on
    where they sit, how many columns surround them or the batch. A sliding window arrives in
    the mask (transformers' and graphcap's alike). ``query`` (B, H, Q, D), ``key``/``value``
    (B, Hkv, S, D); returns (B, Q, H, D) in the query's dtype."""
    if dropout:
        raise ValueError("trainer-exact attention takes no dropout (set attention_dropout=0)")
    groups = query.shape[1] // key.shape[1]
    q = query.float()
    k = key.float().repeat_interleave(groups, dim=1)
    v = value.float().repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    allowed = attended_keys(attention_mask, q.shape[2], k.shape[2], q.device)
    scores = ordered_sum(q[:, :, :, None, :] * k[:, :, None, :, :], -1) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a query of no keys
    weights = torch.exp(scores - top)
    total = ordered_sum(weights, -1)[..., None]
    out = ordered_sum(weights[..., None] * v[:, :, None], -2)
    out = out / torch.where(total > 0, total, torch.ones_like(total))
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def exact_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask, never skipped for a causal flag (:func:`exact_attention` reads
    the mask)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


@functools.cache
def register_exact_attention() -> None:
    """Make :data:`EXACT_ATTENTION` an ``attn_implementation`` name (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(EXACT_ATTENTION, exact_attention)
    AttentionMaskInterface.register(EXACT_ATTENTION, exact_mask)


def real_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counted over the real tokens (0 at padding), as ``generate`` and the
    rollout's prefill count them: a left-padded row's first token is at 0."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


def _with_positions(model: torch.nn.Module) -> Callable[..., Any]:
    """``model.forward`` that fills in :func:`real_positions` where a call passes a 2-D mask
    and no position ids (transformers would count padding as positions)."""
    forward = model.forward
    signature = inspect.signature(forward)

    def positioned(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind_partial(*args, **kwargs).arguments
        mask, ids = given.get("attention_mask"), given.get("input_ids")
        if (
            given.get("position_ids") is None
            and isinstance(mask, torch.Tensor)
            and mask.dim() == 2
            and isinstance(ids, torch.Tensor)
        ):
            given["position_ids"] = real_positions(mask)[:, -ids.shape[-1] :]
            extra = given.pop("kwargs", {})
            return forward(**given, **extra)
        return forward(*args, **kwargs)

    return positioned


def _swaps(model: torch.nn.Module) -> list[tuple[object, str, object]]:
    swaps: list[tuple[object, str, object]] = [(model, "forward", _with_positions(model))]
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            forward = functools.partial(_linear_forward, module)
            swaps.append((module, "forward", forward))
        act = getattr(module, "act_fn", None)
        if isinstance(act, torch.nn.Module):
            swaps.append((act, "forward", exact_silu))
        checkpoint = vars(module).get("_gradient_checkpointing_func")
        if checkpoint is not None:
            swaps.append(
                (module, "_gradient_checkpointing_func", _recomputed_exactly(model, checkpoint))
            )
    return swaps


def _recomputed_exactly(model: torch.nn.Module, checkpoint: Callable[..., Any]) -> Callable:
    """A layer's gradient-checkpointing function whose recomputation in backward, after the
    block has ended, runs under :func:`trainer_exact` again, as its forward did (otherwise it
    recomputes another forward, which torch's checkpoint refuses)."""

    def checkpointed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def exact(*inner: Any, **named: Any) -> Any:
            if model.config._attn_implementation == EXACT_ATTENTION:  # inside the block
                return function(*inner, **named)
            with trainer_exact(model):
                return function(*inner, **named)

        return checkpoint(exact, *args, **kwargs)

    return checkpointed


def _linear_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # the parameters are read at call time: an engine may bind other tensors to them
    return tiled_linear(x, module.weight, module.bias)


@contextlib.contextmanager
def trainer_exact(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, ``model``'s forward computes what a trainer-exact rollout computes:
    wrap the trainer's ``model(input_ids, attention_mask=...)`` in it and take the log-probs
    with :func:`token_logprobs`; they equal the rollout's bit for bit. Differentiable (a
    GRPO/PPO loss backpropagates through it). Refuses the models it does not cover. Restores
    the model's own forwards and attention implementation afterwards."""
    check_exact_model(model)
    register_exact_attention()
    own = getattr(model.config, "_attn_implementation", None) or "eager"
    model.set_attn_implementation(EXACT_ATTENTION)
    try:
        with attributes_swapped(_swaps(model)):
            yield model
    finally:
        model.set_attn_implementation(own)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``tokens``, computed as the rollout records it
    (float32, one division, the last dimension's ``log_softmax``): ``logits`` (..., V),
    ``tokens`` (...). ``temperature=1`` is ``logprobs_mode="raw"``, the call's temperature
    ``"temperature"`` (``"sampling"`` too, without truncation or penalties)."""
    divisor = torch.tensor(temperature, dtype=torch.float32, device=logits.device)
    dist = torch.log_softmax(logits.float() / divisor, dim=-1)
    return dist.gather(-1, tokens[..., None]).squeeze(-1)
