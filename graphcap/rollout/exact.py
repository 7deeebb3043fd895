"""Trainer-exact forwards: a token's log-prob is the same bits in the rollout and the trainer.

An RL trainer recomputes the rollout's log-probs with a full-sequence forward. The decode step,
the prefill and that forward reduce over the same numbers in different orders (the number of
rows picks the matrix product's kernel; the attention's split over keys follows the cache's
length and padding), so the two disagree in the last bits and training is slightly off-policy.
:func:`trainer_exact` makes every reduction of the forward run in an order fixed by the row and
by the key's position alone (docs/decisions.md, decision 85):

The operations are the backend's (:meth:`graphcap.backend.Backend.exact_ops`, an
:class:`~graphcap.exact_ops.ExactOps`; docs/decisions.md, decision 90): the context swaps, for
the block,

- every ``nn.Linear`` (q/k/v/o, the MLP, ``lm_head``) to ``ops.linear``, a product whose sum
  over K runs in an order independent of the number of rows;
- attention to :data:`EXACT_ATTENTION`, which calls ``ops.attention``: each query's sums over
  its keys run in position order, masked keys adding exact zeros, so left padding, a cache's
  unused columns and the batch add nothing;
- the MLP's SiLU and the RMSNorms to ``ops.silu`` / ``ops.rms_norm``, the MLP's
  ``act_fn(gate) * up`` to ``ops.silu_mul`` and the modeling code's ``apply_rotary_pos_emb``
  to ``ops.rotary``, where the backend offers them (``None``: the model's own, measured
  row-invariant there);
- position ids counted over the real tokens, as ``generate`` counts them, where the trainer
  passes none;
- a layer's gradient-checkpointing function (transformers' ``_gradient_checkpointing_func``),
  so the layer's recomputation in backward, after the block, runs under the context again.

The engine runs its calls under the same context (``RolloutConfig.trainer_exact``), its
recorded log-probs through :func:`row_log_softmax`, and the trainer computes its log-probs with
:func:`token_logprobs` (``ops.log_softmax``). The CPU reference backend offers the reference
functions of :mod:`graphcap.exact_ops`; the CUDA plugin offers Triton kernels.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from graphcap.backend import Backend
from graphcap.exact_ops import ExactOps, forward_scope
from graphcap.registry import backend_for_device
from graphcap.rollout.cache.swap import attributes_swapped

#: The attention implementation name trainer-exact forwards run under.
EXACT_ATTENTION = "graphcap_exact"
#: Model types whose every layer :func:`trainer_exact` covers (decoder layers of RMSNorm, RoPE,
#: linear projections, SiLU MLP, full or sliding-window attention).
EXACT_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")


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


def exact_ops_of(backend: Backend) -> ExactOps:
    """``backend``'s trainer-exact operations; refuses a backend that offers none."""
    ops = backend.exact_ops()
    if ops is None:
        raise ValueError(
            f"trainer_exact=True: backend {backend.name!r} offers no trainer-exact operations "
            "(Backend.exact_ops() is None): run on a backend that does (cpu, cuda) or use the "
            "default mode"
        )
    return ops


def _model_backend(model: torch.nn.Module) -> Backend:
    """The backend of the device ``model``'s parameters are on."""
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    return backend_for_device(device.type)


#: The operations of the innermost :func:`trainer_exact` block (the attention and the
#: rollout's log-prob step read them; ``None`` outside any block).
_ACTIVE: ContextVar[ExactOps | None] = ContextVar("graphcap_exact_ops", default=None)


def dispatched_attention(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention registered as :data:`EXACT_ATTENTION`: the active block's backend's."""
    ops = _ACTIVE.get()
    if ops is None:
        raise RuntimeError(
            f"attention {EXACT_ATTENTION!r} runs only inside graphcap.rollout.trainer_exact(model)"
        )
    return ops.attention(*args, **kwargs)


def _log_softmax(ops: ExactOps | None, x: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dimension: ``ops``' where it offers one, else torch's."""
    if ops is not None and ops.log_softmax is not None:
        return ops.log_softmax(x)
    return torch.log_softmax(x, dim=-1)


def row_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dimension: the active trainer-exact block's backend's
    where it offers one, else torch's (the rollout's recorded log-probs go through it)."""
    return _log_softmax(_ACTIVE.get(), x)


def exact_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask, never skipped for a causal flag (the trainer-exact attention
    reads the mask)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


@functools.cache
def register_exact_attention() -> None:
    """Make :data:`EXACT_ATTENTION` an ``attn_implementation`` name (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(EXACT_ATTENTION, dispatched_attention)
    AttentionMaskInterface.register(EXACT_ATTENTION, exact_mask)


def real_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counted over the real tokens (0 at padding), as ``generate`` and the
    rollout's prefill count them: a left-padded row's first token is at 0."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


def _with_positions(model: torch.nn.Module) -> Callable[..., Any]:
    """``model.forward`` that fills in :func:`real_positions` where a call passes a 2-D mask
    and no position ids (transformers would count padding as positions), in a
    :func:`~graphcap.exact_ops.forward_scope`."""
    forward = model.forward
    signature = inspect.signature(forward)

    def positioned(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind_partial(*args, **kwargs).arguments
        mask, ids = given.get("attention_mask"), given.get("input_ids")
        with forward_scope():  # the layers share what they derive from the mask (per_forward)
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


def _swaps(
    model: torch.nn.Module, backend: Backend, ops: ExactOps
) -> list[tuple[object, str, object]]:
    swaps: list[tuple[object, str, object]] = [(model, "forward", _with_positions(model))]
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            swaps.append((module, "forward", functools.partial(_linear_forward, ops, module)))
        if ops.rms_norm is not None and _is_rms_norm(module):
            swaps.append((module, "forward", functools.partial(_norm_forward, ops, module)))
        act = getattr(module, "act_fn", None)
        if ops.silu is not None and isinstance(act, torch.nn.Module):
            swaps.append((act, "forward", ops.silu))
        if ops.silu_mul is not None and _is_gated_mlp(module):
            swaps.append((module, "forward", functools.partial(_mlp_forward, ops, module)))
        checkpoint = vars(module).get("_gradient_checkpointing_func")
        if checkpoint is not None:
            swaps.append(
                (
                    module,
                    "_gradient_checkpointing_func",
                    _recomputed_exactly(model, backend, checkpoint),
                )
            )
    if ops.rotary is not None:
        for code in _modeling_modules(model):
            own = code.apply_rotary_pos_emb
            swaps.append((code, "apply_rotary_pos_emb", functools.partial(_rotary, ops, own)))
    return swaps


def _modeling_modules(model: torch.nn.Module) -> list[Any]:
    """The modeling code (Python modules) of ``model``'s layers that define the covered
    families' ``apply_rotary_pos_emb``, which their attention calls by its global name."""
    names = {type(m).__module__ for m in model.modules()}
    codes = [sys.modules.get(name) for name in sorted(names)]
    return [code for code in codes if callable(getattr(code, "apply_rotary_pos_emb", None))]


def _rotary(
    ops: ExactOps, own: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, cos: Any, sin: Any,
    *args: Any, **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``apply_rotary_pos_emb`` through ``ops.rotary`` where called as the attention calls it
    (``unsqueeze_dim`` 1), else the model's own."""
    if args or kwargs.keys() - {"unsqueeze_dim"} or kwargs.get("unsqueeze_dim", 1) != 1:
        return own(q, k, cos, sin, *args, **kwargs)
    assert ops.rotary is not None
    return ops.rotary(q, k, cos, sin)


def _is_gated_mlp(module: torch.nn.Module) -> bool:
    """The covered families' MLP: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""
    return type(module).__name__.endswith("MLP") and all(
        isinstance(getattr(module, name, None), torch.nn.Module)
        for name in ("gate_proj", "up_proj", "down_proj", "act_fn")
    )


def _mlp_forward(ops: ExactOps, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    assert ops.silu_mul is not None
    return module.down_proj(ops.silu_mul(module.gate_proj(x), module.up_proj(x)))


def _recomputed_exactly(
    model: torch.nn.Module, backend: Backend, checkpoint: Callable[..., Any]
) -> Callable:
    """A layer's gradient-checkpointing function whose recomputation in backward, after the
    block has ended, runs under :func:`trainer_exact` again on the same ``backend``, as its
    forward did (otherwise it recomputes another forward, which torch's checkpoint refuses)."""

    def checkpointed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def exact(*inner: Any, **named: Any) -> Any:
            if model.config._attn_implementation == EXACT_ATTENTION:  # inside the block
                return function(*inner, **named)
            with trainer_exact(model, backend):
                return function(*inner, **named)

        return checkpoint(exact, *args, **kwargs)

    return checkpointed


def _is_rms_norm(module: torch.nn.Module) -> bool:
    """The covered families' RMSNorm (decoder norms, Qwen3's q/k norms)."""
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def _linear_forward(ops: ExactOps, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # the parameters are read at call time: an engine may bind other tensors to them
    return ops.linear(x, module.weight, module.bias)


def _norm_forward(ops: ExactOps, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    assert ops.rms_norm is not None
    return ops.rms_norm(x, module.weight, module.variance_epsilon)


@contextlib.contextmanager
def trainer_exact(
    model: torch.nn.Module, backend: Backend | None = None
) -> Iterator[torch.nn.Module]:
    """Within the block, ``model``'s forward computes what a trainer-exact rollout computes:
    wrap the trainer's ``model(input_ids, attention_mask=...)`` in it and take the log-probs
    with :func:`token_logprobs`; they equal the rollout's bit for bit. Differentiable (a
    GRPO/PPO loss backpropagates through it). The operations are ``backend``'s (default: the
    backend of the device the model's parameters are on). Refuses the models it does not
    cover and backends that offer no trainer-exact operations. Restores the model's own
    forwards and attention implementation afterwards."""
    check_exact_model(model)
    backend = backend if backend is not None else _model_backend(model)
    ops = exact_ops_of(backend)
    register_exact_attention()
    own = getattr(model.config, "_attn_implementation", None) or "eager"
    model.set_attn_implementation(EXACT_ATTENTION)
    token = _ACTIVE.set(ops)
    try:
        with attributes_swapped(_swaps(model, backend, ops)):
            yield model
    finally:
        _ACTIVE.reset(token)
        model.set_attn_implementation(own)


def logprob_distribution(
    logits: torch.Tensor, temperature: float = 1.0, backend: Backend | None = None
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` over the last dimension, computed as the rollout
    records it (float32, one division, the ``log_softmax`` ``backend`` offers for
    trainer-exact calls, by default the backend of ``logits``' device, else torch's): for a
    trainer that needs the whole distribution (an entropy) besides :func:`token_logprobs`."""
    scores = logits.float()
    if temperature != 1.0:  # x / 1 is x exactly: at temperature 1, no vocabulary-wide pass
        scores = scores / torch.tensor(temperature, dtype=torch.float32, device=logits.device)
    chosen = backend if backend is not None else backend_for_device(logits.device.type)
    return _log_softmax(chosen.exact_ops(), scores)


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    backend: Backend | None = None,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``tokens``, computed as the rollout records it
    (:func:`logprob_distribution`): ``logits`` (..., V), ``tokens`` (...). ``temperature=1``
    is ``logprobs_mode="raw"``, the call's temperature ``"temperature"`` (``"sampling"`` too,
    without truncation or penalties). Differentiable."""
    dist = logprob_distribution(logits, temperature, backend)
    return dist.gather(-1, tokens[..., None]).squeeze(-1)
