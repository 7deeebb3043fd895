"""Trainer-exact rollouts for TRL's ``GRPOTrainer``: both sides with one call.

The rollout side is the drop-in in exact mode (:func:`~graphcap.rollout.accelerate_generate`
with ``RolloutConfig(trainer_exact=True)``) under the policy's ``generate``. The trainer's side
is where TRL computes the policy's per-token log-probs: TRL 1.16's ``GRPOTrainer`` installs a
fused LM head on the policy (``trl.trainer.utils.add_fused_lm_head``, an instance ``forward``)
and calls ``model(..., labels=labels, fused_lm_head=True)``, which projects the hidden states in
chunks and takes ``logits - logsumexp``: neither the rollout's products nor its rounding. Within
:func:`trl_trainer_exact` that call runs the model under :func:`~graphcap.rollout.trainer_exact`
and takes the log-probs from :func:`~graphcap.rollout.exact.logprob_distribution` at the trainer's
temperature, so they equal the rollout's bit for bit (docs/trainers.md). ``trl`` is imported
only when the function is called: it stays an optional dependency.

TRL's side of the contract: ``fused_lm_head=True`` and its output, ``FusedCausalLMOutput``, are
``add_fused_lm_head``'s documented interface; that ``GRPOTrainer`` computes its log-probs
through it happens in a private method (``_get_per_token_logps_and_entropies``).
``tests/test_trl_grpo_exact.py`` fails by name if TRL renames it or stops calling the fused head
there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from graphcap.rollout.cache.swap import attributes_swapped
from graphcap.rollout.drop_in import (
    AcceleratedGenerate,
    accelerate_generate,
    drop_in_default_config,
    generating_model,
    restore_generate,
)
from graphcap.rollout.exact import check_exact_model, logprob_distribution, trainer_exact
from graphcap.rollout.settings.rollout_config import RolloutConfig

#: What asks for exact log-probs, named in refusals.
ASKED_BY = "trl_trainer_exact"


@contextlib.contextmanager
def trl_trainer_exact(
    trainer: Any, config: RolloutConfig | None = None
) -> Iterator[AcceleratedGenerate]:
    """Within the block, ``trainer`` (a TRL ``GRPOTrainer``) rolls out with the drop-in in
    exact mode and computes its per-token log-probs under :func:`trainer_exact`, so the two
    are the same bits; ``trainer.train()`` goes inside. ``config``: the drop-in's settings
    (default :func:`drop_in_default_config`), run with ``trainer_exact=True``. Yields the
    installed drop-in (``.stats``); both sides come off at the end of the block.

    Refused with the reason: another trainer, vLLM generation, autocast (``bf16=True`` /
    ``fp16=True``: load the model in the dtype instead), ``cast_lm_head_to_fp32`` (the rollout's
    head computes in the model's dtype), a model :func:`trainer_exact` does not cover, and a TRL
    that does not install its fused LM head."""
    model = checked_policy(trainer)
    fused = vars(model)["forward"]
    exact = exact_log_prob_forward(model, fused, float(trainer.args.temperature))
    config = dataclasses.replace(config or drop_in_default_config(), trainer_exact=True)
    accelerated = accelerate_generate(model, config)
    try:
        with attributes_swapped([(model, "forward", exact)]):
            yield accelerated
    finally:
        restore_generate(model)


def checked_policy(trainer: Any) -> torch.nn.Module:
    """The model whose forward computes ``trainer``'s log-probs (the base model of a PEFT
    policy, where TRL installs its fused LM head); refuses a trainer whose log-probs
    :func:`trl_trainer_exact` cannot make exact."""
    import trl
    from trl.trainer.utils import add_fused_lm_head

    if not isinstance(trainer, trl.GRPOTrainer):
        raise TypeError(f"{ASKED_BY} takes a trl.GRPOTrainer, got {type(trainer).__name__}")
    args = trainer.args
    if args.use_vllm:
        raise ValueError(
            f"{ASKED_BY}: this trainer generates with vLLM (use_vllm=True); trainer-exact "
            "rollouts run under the policy's generate: set use_vllm=False"
        )
    if args.bf16 or args.fp16:
        raise ValueError(
            f"{ASKED_BY}: GRPOConfig(bf16/fp16=True) runs the trainer's forward under autocast, "
            "which the rollout does not: load the model in that dtype and pass bf16=False, "
            "fp16=False"
        )
    if args.cast_lm_head_to_fp32:
        raise ValueError(
            f"{ASKED_BY}: cast_lm_head_to_fp32=True computes the trainer's LM head in float32 "
            "and the rollout's in the model's dtype: leave it False"
        )
    model = generating_model(trainer.model)
    check_exact_model(model, ASKED_BY)
    # the forward add_fused_lm_head installs is a function it defines: its code is one of the
    # constants of add_fused_lm_head's code
    code = getattr(vars(model).get("forward"), "__code__", None)
    if code is None or not any(code is const for const in add_fused_lm_head.__code__.co_consts):
        raise RuntimeError(
            f"{ASKED_BY}: TRL {trl.__version__} installed no fused LM head "
            "(trl.trainer.utils.add_fused_lm_head) on the policy, where TRL 1.16 computes the "
            "log-probs; this TRL computes them elsewhere, which this function does not cover"
        )
    return model


def exact_log_prob_forward(
    model: torch.nn.Module, fused: Callable[..., Any], temperature: float
) -> Callable[..., Any]:
    """The policy's ``forward`` with TRL's fused LM head (``fused``) replaced: a call with
    ``fused_lm_head=True`` returns TRL's ``FusedCausalLMOutput`` (log-probs and entropies of
    the next-token labels, 0 where a label is -100, and their loss), computed from the logits
    of a forward under :func:`trainer_exact`; any other call goes to ``fused``."""
    from trl.trainer.utils import FusedCausalLMOutput

    def forward(
        *args: Any,
        fused_lm_head: bool = False,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
        **kwargs: Any,
    ) -> Any:
        if not fused_lm_head:
            return fused(
                *args,
                labels=labels,
                shift_labels=shift_labels,
                num_items_in_batch=num_items_in_batch,
                **kwargs,
            )
        if torch.is_autocast_enabled(model.device.type):
            raise ValueError(
                f"{ASKED_BY}: the trainer's forward runs under autocast, the rollout's does "
                "not: load the model in the dtype autocast would compute in instead"
            )
        kwargs["use_cache"] = False  # as TRL's head: a full-sequence forward keeps no cache
        with trainer_exact(model):  # re-enters this forward without fused_lm_head
            logits = model(*args, **kwargs).logits
        if shift_labels is None:
            logits, labels = logits[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        mask = labels != -100
        dist = logprob_distribution(logits, temperature)  # one vocabulary-wide pass for both
        log_probs = dist.gather(-1, labels.masked_fill(~mask, 0)[..., None]).squeeze(-1)
        entropy = -(dist.exp() * dist).sum(-1)
        log_probs, entropy = log_probs.masked_fill(~mask, 0), entropy.masked_fill(~mask, 0)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy, label_mask=mask
        )

    # generate and the engine read the forward's parameters: the model's own, as TRL keeps them
    forward.__signature__ = inspect.signature(fused)  # type: ignore[attr-defined]
    return forward
