"""The drop-in under what a trainer's model meets: dropout in ``train()``, ``generate``
called again from inside a served call, and calls the engine would run eagerly (the plan's
refusals: they go to ``generate``)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from fakes import FailingCaptureBackend, NoCollectivesGraphBackend, NoRngGraphBackend
from rollout_models import prompts, tiny_model
from test_drop_in import both

from graphcap.cpu import CPUBackend
from graphcap.errors import CaptureFallbackWarning, GenerateFallbackWarning
from graphcap.rollout import (
    AcceleratedGenerate,
    RolloutConfig,
    accelerate_generate,
    restore_generate,
)
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


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _installed(model, backend, **config) -> AcceleratedGenerate:
    return accelerate_generate(
        model, RolloutConfig(backend=backend, eos_check_interval=1, **config)
    )


def _generate_both(model, calls, accelerated):
    """Each of ``calls`` (keyword arguments of ``model.generate``) under the drop-in, then
    without it, from the same seed: the two outputs of each."""
    ids, mask = prompts(2)
    got = []
    for kwargs in calls:
        torch.manual_seed(0)
        got.append(model.generate(ids, attention_mask=mask, **kwargs))
    restore_generate(model)
    expected = []
    for kwargs in calls:
        torch.manual_seed(0)
        expected.append(model.generate(ids, attention_mask=mask, **kwargs))
    return got, expected


@pytest.mark.parametrize(
    ("case", "backend", "kwargs", "reason"),
    [
        ("one new token", CPUBackend, {"max_new_tokens": 1}, "max_new_tokens=1"),
        ("no rng in graphs", NoRngGraphBackend, {"do_sample": True}, "rng_in_graph=False"),
        ("graphs off", CPUBackend, {}, "enable_graph_capture=False"),
    ],
)
def test_calls_the_engine_would_run_eagerly_go_to_generate(case, backend, kwargs, reason):
    """The engine's plan decides (``require_graph``): a call whose steps it would run eagerly
    never runs graphcap's eager loop, it goes to generate with the plan's reason."""
    model = tiny_model("llama")
    config = {"enable_graph_capture": False} if case == "graphs off" else {}
    accelerated = _installed(model, backend(), **config)
    calls = [{"max_new_tokens": 5, **kwargs}, {"max_new_tokens": 5}]
    with pytest.warns(GenerateFallbackWarning, match=reason):
        got, expected = _generate_both(model, calls, accelerated)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    (recorded,) = accelerated.stats.fallbacks
    assert reason in recorded and accelerated.stats.fallbacks[recorded] == 1 + (
        case == "graphs off"
    )
    assert accelerated.stats.served == (case != "graphs off")  # the plain greedy call
    assert accelerated.engine.captures == (case != "graphs off")


def test_after_a_failed_capture_calls_go_to_generate():
    """The call whose capture failed finishes on the engine's eager steps (it had started);
    every later call goes to generate with the failure as the reason."""
    model = tiny_model("llama")
    accelerated = _installed(model, FailingCaptureBackend())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureFallbackWarning)
        with pytest.warns(GenerateFallbackWarning, match="capture failed"):
            got, expected = _generate_both(model, [{"max_new_tokens": 5}] * 3, accelerated)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert accelerated.stats.served == 1 and accelerated.stats.last.path == "eager"
    (recorded,) = accelerated.stats.fallbacks
    assert "capture failed" in recorded and accelerated.stats.fallbacks[recorded] == 2


def test_tensor_parallel_calls_on_a_backend_without_collectives_in_graphs_go_to_generate(
    one_rank_group,
):
    """NPU declares collectives_in_graph=False: with a process group its calls would run
    eagerly, so they go to generate (a CPU stand-in here; the NPU plugin's tests run NPU's)."""
    model = tiny_model("llama")
    accelerated = _installed(model, NoCollectivesGraphBackend(), process_group=one_rank_group)
    with pytest.warns(GenerateFallbackWarning, match="collectives_in_graph=False"):
        got, expected = _generate_both(model, [{"max_new_tokens": 5}], accelerated)
    assert torch.equal(got[0], expected[0]) and accelerated.stats.served == 0
