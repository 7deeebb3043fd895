"""A training run on a real accelerator: sleeps that keep the graphs, training steps and moved
weights replay without a new capture, and the memory a sleep gives back shows in the device's
own free-memory report (tests/test_training_loop.py runs the same loop on the CPU reference
backend). Skipped unless an accelerator backend that keeps addresses across a release is
selected (on CUDA: ``pip install ./backends/cuda[sleep]``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from rollout_models import prompts, tiny_model
from test_device_rollout import backend  # noqa: F401 - the module's fixture
from test_training_loop import move_storage, same_values, train_step

from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams, accelerate_generate

pytestmark = pytest.mark.device

ROWS = 8
SAMPLED = [SamplingParams(max_new_tokens=12, do_sample=True, seed=7 + i) for i in range(ROWS)]


def keeping(backend) -> None:  # noqa: F811 - the fixture's value
    if not backend.capabilities.keeps_addresses_on_release:
        pytest.skip(f"backend {backend.name!r} cannot keep addresses across a release")


@pytest.mark.parametrize("path", ["static", "continuous"])
def test_a_training_loop_captures_once_on_the_device(backend, path):  # noqa: F811
    keeping(backend)
    model = tiny_model("llama", fresh=True).to(backend.device)
    twin = copy.deepcopy(model)
    settings = {"continuous_batch_size": 4} if path == "continuous" else {}
    config = RolloutConfig(
        enable_graph_capture=True, backend=backend, length_buckets=(8192,), **settings
    )
    engine, reference = RolloutEngine(model, config), RolloutEngine(twin, config)
    ids, mask = (t.to(backend.device) for t in prompts(ROWS))
    first = engine.generate(ids, mask, SAMPLED)
    assert first.stats.path.endswith("graph"), first.stats.fallback_reason
    captures, held = first.stats.captures, engine.memory_held()
    assert held > 0
    given = []
    for i in range(4):
        engine.sleep()
        report = engine.last_sleep
        assert report.kept_graphs and engine.sleeping
        given.append(report.given_back)
        train_step(model, first.sequences)
        same_values(twin, model)
        if i == 3:
            move_storage(model, new_values=False)
        again = engine.generate(ids, mask, SAMPLED)
        expected = reference.generate(ids, mask, SAMPLED)
        assert torch.equal(again.sequences, expected.sequences), f"iteration {i}"
        assert again.stats.captures == captures, again.stats.recapture_reason
        assert again.stats.wake_s is not None
    print(f"held {held} bytes; given back at each sleep {given}")
    assert all(g is not None and g >= 0.9 * held for g in given), (held, given)


def test_the_drop_in_sleeps_between_calls(backend):  # noqa: F811
    keeping(backend)
    model = tiny_model("llama", fresh=True).to(backend.device)
    installed = accelerate_generate(model)
    assert installed.sleep_between_calls
    ids, mask = (t.to(backend.device) for t in prompts(ROWS))
    outputs, captures = [], []
    for _ in range(3):
        torch.manual_seed(0)
        outputs.append(model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=8))
        assert installed.engine.sleeping
        captures.append(installed.stats.captures)
    assert captures[0] == captures[-1] and installed.stats.served == 3
    assert all(torch.equal(o, outputs[0]) for o in outputs)
    report = installed.engine.last_sleep
    print(
        f"drop-in: held {report.held_bytes}, given back {report.given_back}, "
        f"wake {installed.stats.last.wake_s}"
    )
    installed.restore()
