"""TRL's GRPOTrainer with graphcap under the policy's ``generate`` (docs/trainers.md).

    python examples/trl_grpo.py                        # tiny random Llama, this machine's backend
    python examples/trl_grpo.py --compare --draws generate  # also the run without graphcap
    python examples/trl_grpo.py --model llama-1b --dtype bf16 --compare --json out.json  # a GPU

The trainer is TRL's own, unchanged: graphcap goes under ``model.generate`` with one call after
the trainer is built (:func:`graphcap.rollout.accelerate_generate`) and comes off with another.
With ``--compare`` the run is repeated without graphcap from the same seed; the completions of
every step are compared (equal token for token under ``--draws generate``; graphcap's default
per-row draws sample the same distribution from other random numbers) and each run's rollout
seconds per step are printed (rollout = the ``generate`` call TRL makes per step; the first
step's includes graphcap's capture). Models are built from a preset's config with random
weights and a word-level tokenizer over the model's vocabulary (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import graphcap
from graphcap.preset_models import DTYPES, build_model
from graphcap.rollout import accelerate_generate, drop_in_default_config, restore_generate
from graphcap.tiny_models import tiny_model

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
#: The tiny policy's config fields beyond graphcap.tiny_models' defaults.
TINY = dict(vocab_size=64, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Specials, then one word ``w<i>`` per remaining id: any id decodes, any prompt encodes."""
    names = SPECIALS + [f"w{i}" for i in range(len(SPECIALS), vocab_size)]
    words = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, "<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def policy(preset: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A random-weight policy: the tiny Llama, or a ``graphcap bench`` preset's shape."""
    if preset == "tiny":
        model = tiny_model("llama", seed=0, **TINY).train()  # the mode a trainer starts in
        return model.to(device=device, dtype=dtype)
    model = build_model(preset, dtype=dtype, device=device, seed=0)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    model.config.pad_token_id, model.config.eos_token_id = 0, 2
    return model


def prompts(count: int, words: int, vocab_size: int) -> list[str]:
    """``count`` prompts of 1..``words`` random words (prompt widths vary, as in real data)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, words + 1, (count,), generator=gen).tolist()
    ids = torch.randint(len(SPECIALS), vocab_size, (count, words), generator=gen)
    return [
        " ".join(f"w{i}" for i in row[:n]) for row, n in zip(ids.tolist(), lengths, strict=True)
    ]


class Timed:
    """Times every ``generate`` call of one model (between device synchronisations)."""

    def __init__(self, model: torch.nn.Module, sync: Callable[[], None]) -> None:
        self.model, self.sync, self.seconds = model, sync, []
        self.inner = model.generate

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.sync()
        start = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.sync()
        self.seconds.append(time.perf_counter() - start)
        return out


def run(args: argparse.Namespace, with_graphcap: bool) -> dict[str, Any]:
    """One training run: its completions per step, rollout seconds per step, graphcap's stats."""
    backend = graphcap.get_backend()
    model = policy(args.model, DTYPES[args.dtype], backend.device)
    vocab = model.config.vocab_size
    rollouts: list[list[list[int]]] = []

    def even_share(prompts, completions, completion_ids, **kwargs) -> list[float]:
        """A rule-based reward: the share of completion tokens with an even id."""
        rollouts.append([list(map(int, ids)) for ids in completion_ids])
        return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    config = trl.GRPOConfig(
        output_dir=str(Path(args.output_dir) / ("graphcap" if with_graphcap else "plain")),
        per_device_train_batch_size=args.batch_size,
        num_generations=args.generations,
        max_completion_length=args.new_tokens,
        max_steps=args.steps,
        learning_rate=1e-5,
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
    )
    accelerated = None
    if with_graphcap:
        base = drop_in_default_config()
        accelerated = accelerate_generate(trainer.model, replace(base, draws=args.draws))
    timed = Timed(model, backend.synchronize)
    model.generate = timed
    try:
        trainer.train()
    finally:
        model.generate = timed.inner
        if accelerated is not None:
            restore_generate(trainer.model)
    stats = None if accelerated is None else accelerated.stats
    return {
        "graphcap": with_graphcap,
        "rollout_s": timed.seconds,
        "completions": rollouts,
        "served": None if stats is None else stats.served,
        "fallbacks": None if stats is None else dict(stats.fallbacks),
        "captures": None if stats is None else stats.captures,
        "replays": None if stats is None else stats.replays,
        "path": None if stats is None or stats.last is None else stats.last.path,
        "compiled": None if stats is None or stats.last is None else stats.last.compiled,
    }


def summary(result: dict[str, Any]) -> str:
    times = result["rollout_s"]
    later = statistics.median(times[1:]) if len(times) > 1 else float("nan")
    line = f"{'graphcap' if result['graphcap'] else 'plain   '}: rollout s per step " + " ".join(
        f"{t:.3f}" for t in times
    )
    line += f" (median after the first {later:.3f})"
    if result["graphcap"]:
        line += (
            f"; served {result['served']}, captures {result['captures']}, replays "
            f"{result['replays']}, path {result['path']}, compiled {result['compiled']}"
        )
        if result["fallbacks"]:
            line += f", fallbacks {result['fallbacks']}"
    return line


def agreement(a: list[list[list[int]]], b: list[list[list[int]]]) -> float:
    """Share of completion tokens equal position by position (a differing length counts)."""
    same = total = 0
    for step_a, step_b in zip(a, b, strict=True):
        for row_a, row_b in zip(step_a, step_b, strict=True):
            total += max(len(row_a), len(row_b))
            same += sum(x == y for x, y in zip(row_a, row_b, strict=False))
    return same / total if total else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, or a graphcap bench preset")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4, help="rows a step generates")
    parser.add_argument("--generations", type=int, default=2, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--words", type=int, default=6, help="the longest prompt, in words")
    parser.add_argument("--compare", action="store_true", help="also run without graphcap")
    parser.add_argument(
        "--draws",
        default="per_row",
        choices=["per_row", "generate"],
        help="how sampled rows draw (RolloutConfig.draws): per-row streams (graphcap's "
        "default: the same distribution, other random numbers) or generate's own numbers, "
        "so that --compare finds the plain run's completions token for token",
    )
    parser.add_argument("--output-dir", default="/tmp/graphcap-trl-grpo")
    parser.add_argument("--json", help="write both runs' figures here")
    args = parser.parse_args()
    results = [run(args, with_graphcap=False)] if args.compare else []
    results.append(run(args, with_graphcap=True))
    for result in results:
        print(summary(result))
    if args.compare:
        share = agreement(results[0]["completions"], results[1]["completions"])
        print(f"completions equal to the plain run's: {share:.1%} of tokens")
    if args.json:
        report = {"args": vars(args), "versions": versions(), "runs": results}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


def versions() -> dict[str, str]:
    import transformers

    return {m.__name__: m.__version__ for m in (graphcap, torch, transformers, trl)}


if __name__ == "__main__":
    main()
