"""Compiled captures route the model's projections through the backend's one-row product
(``Backend.one_row_product``): every plain ``nn.Linear`` and every joined group, within the
capture only, and nothing changes on backends that offer none."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from rollout_models import prompts, run, tiny_model
from test_rollout_plan import NEW, NO_EOS, CompiledCaptureBackend

from graphcap.errors import CaptureFallbackWarning
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.plan.fusion import ProjectionFusion
from graphcap.rollout.plan.regions import one_row_products
from graphcap.rollout.plan.scan import scan_model


def recording() -> tuple[object, list[int]]:
    """A product that equals ``F.linear`` and notes each weight's row count."""
    calls: list[int] = []

    def product(x, weight, bias=None):
        calls.append(weight.shape[0])
        return F.linear(x, weight, bias)

    return product, calls


def plain_linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "joined"])
def test_every_projection_computes_through_the_product_within_the_block_only(fuse):
    model = tiny_model("llama", fresh=True)
    fusion = ProjectionFusion(model) if fuse else None
    if fusion is not None:
        fusion.join(scan_model(model))
    ids, mask = prompts(1)
    joined = fusion.applied() if fusion is not None else contextlib.nullcontext()
    with torch.no_grad(), joined:
        expected = model(ids, attention_mask=mask).logits
        product, calls = recording()
        with one_row_products(model, product, fusion):
            logits = model(ids, attention_mask=mask).logits
    assert torch.equal(logits, expected)
    cfg = model.config
    kv = cfg.num_key_value_heads * cfg.head_dim
    hidden, inner = cfg.hidden_size, cfg.intermediate_size
    per_layer = (
        [hidden + 2 * kv, hidden, 2 * inner, hidden]
        if fuse
        else [hidden, kv, kv, hidden, inner, inner, hidden]
    )
    assert calls == per_layer * cfg.num_hidden_layers + [cfg.vocab_size]  # lm_head last
    assert not any("forward" in vars(linear) for linear in plain_linears(model))
    assert fusion is None or all(group.product is F.linear for group in fusion.groups)


class OneRowBackend(CompiledCaptureBackend):
    """A backend offering a one-row product (recording its calls)."""

    def __init__(self):
        super().__init__()
        self.product, self.calls = recording()

    def one_row_product(self):
        return self.product


def test_compiled_captures_use_the_product_and_other_steps_never_do(monkeypatch):
    """The CPU reference graph refuses compiled regions at capture, so the call ends eagerly;
    the product served the compiled warm-up and capture, and nothing else."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager"))
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(1)
    expected = run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS)
    for compiled in (False, True):
        backend = OneRowBackend()
        config = RolloutConfig(enable_graph_capture=True, backend=backend, compile=compiled)
        params = SamplingParams(max_new_tokens=NEW, **NO_EOS)
        warns = pytest.warns(CaptureFallbackWarning) if compiled else contextlib.nullcontext()
        with warns:
            result = RolloutEngine(model, config).generate(ids, mask, params)
        assert torch.equal(result.sequences, expected.sequences)
        assert bool(backend.calls) == compiled, backend.calls
        assert not any("forward" in vars(linear) for linear in plain_linears(model))


def test_the_base_backend_offers_no_product():
    from graphcap.cpu import CPUBackend

    assert CPUBackend().one_row_product() is None
