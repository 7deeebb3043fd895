"""``accelerate_generate`` on a real accelerator backend (``GRAPHCAP_BACKEND=cuda``...).

The CPU suite checks the drop-in on every commit; here the same claims run on a device, with
the backend's default configuration (compiled captured steps where it declares them): served
calls return generate's tokens in fp32, greedy and sampled under one seed, and the generator is
left where generate leaves it. Skipped unless an accelerator backend is selected.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_models import EOS, prompts, tiny_model

import graphcap
from graphcap.errors import BackendSelectionError
from graphcap.rollout import accelerate_generate, drop_in_default_config, restore_generate

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def backend(requested_backend: str | None) -> graphcap.Backend:
    if not requested_backend or requested_backend == "cpu":
        pytest.skip("device tests need an accelerator backend: set GRAPHCAP_BACKEND=cuda (or npu)")
    try:
        return graphcap.get_backend(requested_backend)
    except BackendSelectionError as exc:
        pytest.skip(f"backend {requested_backend!r} not usable here: {exc}")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize(
    "settings",
    [
        {"max_new_tokens": 12},
        {"max_new_tokens": 12, "do_sample": True, "top_k": 0, "eos_token_id": [EOS, 5]},
        {"max_new_tokens": 10, "do_sample": True, "num_return_sequences": 2, "top_p": 0.9},
    ],
    ids=["greedy", "sampled", "samples-per-prompt"],
)
def test_served_calls_return_generates_tokens(backend, family, settings):
    # a vocabulary over 128 ids: top-p's scan over it is what inductor splits across programs
    model = tiny_model(family, fresh=True, vocab_size=1000).to(backend.device)
    ids, mask = (t.to(backend.device) for t in prompts(3))
    backend.manual_seed(0)
    expected = model.generate(ids, attention_mask=mask, **settings)
    expected_rng = backend.get_rng_state()
    # generate's own random numbers (the default draws per row: same distribution, other numbers)
    accelerated = accelerate_generate(model, replace(drop_in_default_config(), draws="generate"))
    try:
        backend.manual_seed(0)
        got = model.generate(ids, attention_mask=mask, **settings)
        got_rng = backend.get_rng_state()
    finally:
        restore_generate(model)
    stats = accelerated.stats
    assert stats.served == 1 and not stats.fallbacks, dict(stats.fallbacks)
    assert stats.last.path == "static_graph"
    assert stats.last.compiled == backend.capabilities.compile_by_default
    assert torch.equal(got, expected), (got, expected)
    assert torch.equal(got_rng, expected_rng), "the generator was left elsewhere than generate's"
