"""TRL's GRPOTrainer with trainer-exact rollouts (issue 53): TRL's log-probs are the rollout's.

``examples/trl_grpo_exact.py`` runs, as written, on the CPU reference backend: a tiny random
Llama trained by TRL's own GRPOTrainer for four optimizer steps (two rollouts, each updated on
twice, so TRL recomputes every rollout's log-probs before its first update), with
``graphcap.rollout.trl_trainer_exact`` around ``trainer.train()``. Every completion token's
log-prob TRL recomputes equals the rollout's bit for bit; without the trainer's side (the
drop-in alone in exact mode) they are not, so the comparison can fail. fp32, bf16, and a LoRA
adapter through PEFT. Skipped where ``trl`` is not installed.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import pytest
import torch
from script_runs import run_on_cpu

from graphcap.rollout import trl_trainer_exact

trl = pytest.importorskip("trl")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "trl_grpo_exact.py"
#: a rollout of 8 rows of up to 16 tokens: some end at EOS (their padding masked on both sides)
SHAPE = ("--batch-size", "8", "--generations", "4", "--new-tokens", "16")


def run_example(tmp_path: Path, *args: str) -> dict:
    report = tmp_path / "run.json"
    run_on_cpu(EXAMPLE, *SHAPE, *args, "--output-dir", str(tmp_path), "--json", str(report))
    return json.loads(report.read_text())


@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp32-lora"])
def test_trls_recomputed_logprobs_equal_the_rollouts_bit_for_bit(tmp_path, policy):
    """fp32 and bf16 weights; a PEFT LoRA adapter (TRL's fused head on the base model)."""
    dtype, *lora = policy.split("-")
    result = run_example(tmp_path, "--dtype", dtype, *(f"--{x}" for x in lora))
    assert result["bitwise_equal"] == result["tokens"], result
    assert result["max_abs_dlogp"] == 0
    assert result["completions"] == 16 and result["ended_early"] > 0  # padding on both sides
    assert result["served"] == 2 and not result["fallbacks"]  # both rollouts on graphs
    assert result["path"] == "static_graph"
    assert result["updated"]  # the loss backpropagated through the exact forward, whose layers
    # TRL checkpoints (GRPOConfig's default): recomputed in backward under trainer_exact


def test_without_the_trainers_side_trls_logprobs_differ(tmp_path):
    """The negative control: the drop-in alone in exact mode; TRL's chunked LM head and
    ``logits - logsumexp`` round differently from the rollout."""
    result = run_example(tmp_path, "--trainer-side", "off")
    assert result["bitwise_equal"] < 0.5 * result["tokens"], result
    assert 0 < result["max_abs_dlogp"] < 1e-3  # the same model, rounded differently


def test_trls_logprob_forward_is_where_trl_trainer_exact_hooks():
    """``trl_trainer_exact`` replaces the fused LM head TRL installs on the policy: it counts
    on GRPOTrainer's private ``_get_per_token_logps_and_entropies`` calling it. A TRL that
    renames the method or stops calling the head there fails here by name."""
    from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

    method = getattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", None)
    assert method is not None, "TRL renamed GRPOTrainer._get_per_token_logps_and_entropies"
    assert "fused_lm_head=True" in inspect.getsource(method), (
        "GRPOTrainer no longer computes its log-probs through add_fused_lm_head's forward"
    )
    fields = set(FusedCausalLMOutput.__annotations__)
    assert {"log_probs", "entropy", "loss", "label_mask"} <= fields
    assert "fused_lm_head" in inspect.getsource(add_fused_lm_head)


def grpo_trainer(tmp_path: Path, **fields: object) -> trl.GRPOTrainer:
    """A GRPOTrainer of the example's tiny policy, with ``fields`` set on its config."""
    from datasets import Dataset

    spec = importlib.util.spec_from_file_location("trl_grpo", EXAMPLES / "trl_grpo.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    config = trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        use_cpu=True,
        report_to="none",
        **{"bf16": False} | fields,
    )
    return trl.GRPOTrainer(
        model=example.policy("tiny", torch.float32, torch.device("cpu")),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": example.prompts(2, 4, 64)}),
        processing_class=example.word_tokenizer(64),
    )


def test_what_trl_trainer_exact_cannot_make_exact_is_refused_with_the_reason(tmp_path):
    with pytest.raises(TypeError, match=r"trl\.GRPOTrainer"), trl_trainer_exact(object()):
        pass
    trainer = grpo_trainer(tmp_path, cast_lm_head_to_fp32=True)
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32"), trl_trainer_exact(trainer):
        pass
    plain = grpo_trainer(tmp_path)
    model = plain.model
    own = vars(model)["forward"]
    with trl_trainer_exact(plain) as accelerated:
        assert vars(model)["forward"] is not own and accelerated.engine.config.trainer_exact
    assert vars(model)["forward"] is own and "generate" not in vars(model)  # both sides off
    del model.forward  # a policy without TRL's fused head: its log-probs are computed elsewhere
    with pytest.raises(RuntimeError, match="add_fused_lm_head"), trl_trainer_exact(plain):
        pass
