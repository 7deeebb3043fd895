"""TRL's GRPOTrainer with trainer-exact rollouts: its log-probs are the rollout's, bit for bit.

    python examples/trl_grpo_exact.py                     # tiny random Llama, fp32, CPU
    python examples/trl_grpo_exact.py --dtype bf16
    python examples/trl_grpo_exact.py --lora              # a PEFT LoRA adapter trained
    python examples/trl_grpo_exact.py --trainer-side off  # the rollout alone exact: not equal

The trainer is TRL's own. :func:`graphcap.rollout.trl_trainer_exact` puts the drop-in, in exact
mode, under the policy's ``generate`` and runs TRL's log-prob forward under
:func:`graphcap.rollout.trainer_exact` (docs/trainers.md, "Trainer-exact rollouts"). With
``num_iterations=2`` TRL recomputes the log-probs of every rollout before its first update
(``old_per_token_logps``, the denominator of its importance ratio); the example records them at
``compute_loss`` and the rollout's (from the drop-in's ``output_logits``, with
:func:`graphcap.rollout.token_logprobs` at TRL's temperature), and prints the share of completion
tokens whose two log-probs are the same bits. ``--trainer-side off`` keeps the drop-in exact but
lets TRL compute its log-probs its own way (a chunked LM head and ``logits - logsumexp``).
CPU reference backend only: trainer-exact mode has no device kernels yet.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import trl
from datasets import Dataset
from trl_grpo import policy, prompts, word_tokenizer  # the tiny policy of examples/trl_grpo.py

import graphcap
from graphcap.preset_models import DTYPES
from graphcap.rollout import (
    AcceleratedGenerate,
    accelerate_generate,
    drop_in_default_config,
    restore_generate,
    token_logprobs,
    trl_trainer_exact,
)

#: (prompt's real tokens, completion tokens) -> that completion's per-token log-probs
Record = dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor]


class RolloutLogprobs:
    """The installed ``generate`` asked for its logits too; records each row's log-probs of
    its new tokens at ``temperature`` and returns the sequences, as TRL asked."""

    def __init__(self, model: torch.nn.Module, temperature: float) -> None:
        self.inner, self.temperature, self.rows = model.generate, temperature, []

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any):
        out = self.inner(
            input_ids,
            attention_mask=attention_mask,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
        new = out.sequences[:, input_ids.shape[1] :]
        logps = token_logprobs(torch.stack(out.logits, 1), new, self.temperature)
        for ids, mask, tokens, values in zip(input_ids, attention_mask, new, logps, strict=True):
            self.rows.append((tuple(ids[mask.bool()].tolist()), tokens.tolist(), values))
        return out.sequences

    def of(self, prompt: tuple[int, ...], completion: tuple[int, ...]) -> torch.Tensor:
        """The rollout's log-probs of a completion TRL kept (cut after its first EOS)."""
        for seen, tokens, values in self.rows:
            if seen == prompt and tuple(tokens[: len(completion)]) == completion:
                return values[: len(completion)]
        raise KeyError(f"no rollout row generated {completion} after {prompt}")


def trl_logprobs(trainer: trl.GRPOTrainer) -> Record:
    """Records TRL's recomputed log-probs (``old_per_token_logps``) at each ``compute_loss``."""
    record: Record = {}
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        old = inputs["old_per_token_logps"]
        rows = zip(
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            inputs["completion_ids"],
            inputs["completion_mask"],
            old,
            strict=True,
        )
        for prompt, prompt_mask, completion, mask, values in rows:
            real, kept = prompt[prompt_mask.bool()], completion[mask.bool()]
            record[tuple(real.tolist()), tuple(kept.tolist())] = values[mask.bool()].clone()
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    return record


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One training run; the two sides' log-probs of every completion token compared."""
    backend = graphcap.get_backend()
    model = policy("tiny", DTYPES[args.dtype], backend.device)
    vocab = model.config.vocab_size

    def even_share(prompts, completions, completion_ids, **kwargs) -> list[float]:
        """A rule-based reward: the share of completion tokens with an even id."""
        return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    config = trl.GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.generations,
        max_completion_length=args.new_tokens,
        max_steps=args.steps,
        num_iterations=2,  # TRL recomputes each rollout's log-probs before updating on it
        temperature=args.temperature,
        learning_rate=1e-3,
        beta=0.0,
        seed=42,
        use_cpu=backend.device.type == "cpu",
        bf16=False,  # the weights are already in --dtype: no autocast around each forward
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    data = Dataset.from_dict({"prompt": prompts(args.steps * args.batch_size, args.words, vocab)})
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=even_share,
        args=config,
        train_dataset=data,
        processing_class=word_tokenizer(vocab),
        peft_config=lora() if args.lora else None,
    )
    trl_side = trl_logprobs(trainer)
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trained]
    with both_sides(trainer, args.trainer_side == "on") as accelerated:
        rollout = RolloutLogprobs(model, args.temperature)
        model.generate = rollout
        try:
            trainer.train()
        finally:
            model.generate = rollout.inner
    pairs = [(rollout.of(*key), values) for key, values in trl_side.items()]
    got = torch.cat([a for a, _ in pairs])
    want = torch.cat([b for _, b in pairs])
    return {
        "trainer_side": args.trainer_side,
        "tokens": got.numel(),
        "bitwise_equal": int((got == want).sum()),
        "max_abs_dlogp": float((got - want).abs().max()),
        "completions": len(pairs),
        "ended_early": sum(len(completion) < args.new_tokens for _, completion in trl_side),
        "updated": not all(map(torch.equal, before, trained)),
        "served": accelerated.stats.served,
        "fallbacks": dict(accelerated.stats.fallbacks),
        "path": accelerated.stats.last.path if accelerated.stats.last else None,
    }


def lora() -> Any:
    """A LoRA adapter on the attention's q and v projections, without dropout (a rollout
    with dropout on draws masks the trainer's forward does not: the drop-in refuses it)."""
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


@contextlib.contextmanager
def both_sides(trainer: trl.GRPOTrainer, trainer_side: bool) -> Iterator[AcceleratedGenerate]:
    """The drop-in in exact mode, with the trainer's side (``trl_trainer_exact``) or without
    it (TRL's own log-probs: the negative control)."""
    if trainer_side:
        with trl_trainer_exact(trainer) as accelerated:
            yield accelerated
        return
    config = dataclasses.replace(drop_in_default_config(), trainer_exact=True)
    try:
        yield accelerate_generate(trainer.model, config)
    finally:
        restore_generate(trainer.model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (2 per rollout)")
    parser.add_argument("--batch-size", type=int, default=4, help="rows a rollout generates")
    parser.add_argument("--generations", type=int, default=2, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--words", type=int, default=6, help="the longest prompt, in words")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--trainer-side", default="on", choices=["on", "off"])
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (PEFT)")
    parser.add_argument("--output-dir", default="/tmp/graphcap-trl-grpo-exact")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    result = run(args)
    share = result["bitwise_equal"] / result["tokens"]
    print(
        f"trainer side {args.trainer_side}: rollout log-probs bitwise equal to TRL's: "
        f"{share:.1%} of {result['tokens']} completion tokens (max |Δlogp| "
        f"{result['max_abs_dlogp']:.3g}); served {result['served']} on {result['path']}, "
        f"fallbacks {result['fallbacks'] or 'none'}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
