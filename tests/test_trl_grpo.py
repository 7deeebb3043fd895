"""TRL's GRPOTrainer with graphcap under the policy's ``generate``: a real trainer run.

A tiny random-weight Llama, an in-memory prompt set and a rule-based reward; the trainer
samples (its default) with its fixed seed. The run with graphcap must produce exactly the
completions of the run without it, step by step, and graphcap's stats must show that the
rollouts were graph replays. Skipped where ``trl`` is not installed (the cpu tox environment
installs it).
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from graphcap.rollout import accelerate_generate, restore_generate  # noqa: E402

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "ran",
    "fast",
    "slow",
    "red",
    "blue",
    "one",
    "two",
    "three",
    "four",
    "five",
    "yes",
    "no",
]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
VOCAB = {token: i for i, token in enumerate(SPECIALS + WORDS)}
PROMPTS = ["the cat sat on the mat", "a dog ran", "one two three", "red blue", "the dog sat"]
STEPS = 3


def tokenizer() -> PreTrainedTokenizerFast:
    words = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def policy() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,
        pad_token_id=VOCAB["<pad>"],
        bos_token_id=VOCAB["<s>"],
        eos_token_id=VOCAB["</s>"],
    )
    return LlamaForCausalLM(config)


def train(tmp_path, with_graphcap: bool):
    """Three optimizer steps; each step's completions (token ids) and graphcap's stats."""
    completions: list[list[list[int]]] = []
    target = VOCAB["cat"]

    def reward(prompts, completions_text, completion_ids, **kwargs):
        completions.append([list(map(int, ids)) for ids in completion_ids])
        return [sum(t == target for t in ids) / max(len(ids), 1) for ids in completion_ids]

    reward.__name__ = "cat_share"
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / ("graphcap" if with_graphcap else "plain")),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=STEPS,
        learning_rate=1e-2,
        beta=0.0,
        seed=42,
        use_cpu=True,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    data = datasets.Dataset.from_dict({"prompt": PROMPTS * 4})
    trainer = trl.GRPOTrainer(
        model=policy(),
        reward_funcs=lambda prompts, completions, completion_ids, **kw: reward(
            prompts, completions, completion_ids, **kw
        ),
        args=args,
        train_dataset=data,
        processing_class=tokenizer(),
    )
    accelerated = accelerate_generate(trainer.model) if with_graphcap else None
    try:
        trainer.train()
    finally:
        if accelerated is not None:
            restore_generate(trainer.model)
    assert trainer.state.global_step == STEPS
    return completions, None if accelerated is None else accelerated.stats


def test_grpo_with_graphcap_samples_exactly_what_it_samples_without(tmp_path):
    plain, _ = train(tmp_path, with_graphcap=False)
    accelerated, stats = train(tmp_path, with_graphcap=True)
    assert len(plain) == STEPS and accelerated == plain
    assert stats.served == STEPS and not stats.fallbacks, dict(stats.fallbacks)
    assert stats.replays > 0 and stats.last.path == "static_graph"
    assert stats.captures == 1  # every prompt width fell in one length bucket
    assert len({token for step in plain for row in step for token in row}) > 3  # not degenerate
