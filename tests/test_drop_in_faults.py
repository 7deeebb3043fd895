"""The drop-in under what a trainer's model meets: dropout in ``train()``, and ``generate``
called again from inside a served call."""

from __future__ import annotations

import threading

import pytest
import torch
from rollout_models import prompts, tiny_model
from test_drop_in import both

from graphcap.errors import GenerateFallbackWarning
from graphcap.rollout import accelerate_generate, restore_generate
from graphcap.rollout.drop_in import NESTED


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("gpt2", {}), ("llama", {"attention_dropout": 0.5})],
    ids=["gpt2-default-dropout", "llama-attention-dropout"],
)
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_a_model_training_with_dropout_goes_to_generate(family, overrides, do_sample):
    """generate draws dropout masks in every forward of a model in train() (TRL generates in
    train()); graphcap hands such calls to it, and serves them again after eval()."""
    model = tiny_model(family, fresh=True, **overrides)
    model.train()
    ids, mask = prompts(3)

    def call():
        return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=do_sample)

    with pytest.warns(GenerateFallbackWarning, match="dropout"):
        expected, got, accelerated, same_rng = both(model, call)
    assert torch.equal(got, expected) and same_rng and accelerated.stats.served == 0
    model.eval()
    expected, got, accelerated, _ = both(model, call)
    assert torch.equal(got, expected) and accelerated.stats.served == 1


def test_a_generate_nested_in_a_forward_hook_falls_back_and_never_hangs():
    """A forward hook that calls generate during a served call (on the same thread) gets
    transformers' generate, as it would without graphcap; the outer call is still served."""
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    nested: list[torch.Tensor] = []

    def hook(module, args, output):
        if not nested:
            nested.append(None)  # once, and not again from the nested call's own forwards
            nested[0] = model.generate(ids, attention_mask=mask, max_new_tokens=3)

    expected_nested = model.generate(ids, attention_mask=mask, max_new_tokens=3)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6)
    model.register_forward_hook(hook)
    accelerated = accelerate_generate(model)
    result: list[object] = []
    worker = threading.Thread(
        target=lambda: result.append(model.generate(ids, attention_mask=mask, max_new_tokens=6)),
        daemon=True,
    )
    with pytest.warns(GenerateFallbackWarning, match="nested"):
        worker.start()
        worker.join(timeout=60)
    # a deadlocked worker holds the engine's lock, which restoring would wait on too
    assert not worker.is_alive(), "a nested generate() deadlocked"
    restore_generate(model)
    assert torch.equal(nested[0], expected_nested)
    assert torch.equal(result[0], expected)
    assert accelerated.stats.served == 1 and accelerated.stats.fallbacks[NESTED] == 1
