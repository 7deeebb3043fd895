"""Whether captured steps compile: ``RolloutConfig.compile`` (``None`` by default) against the
backend's declared ``compiles_by_default``; the CPU reference backend never compiles unasked."""

from __future__ import annotations

import pytest
import torch
from rollout_models import prompts, run, tiny_model

from graphcap.cpu import CPUBackend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.plan import plan_call
from graphcap.rollout.sampling import SamplerShape
from graphcap.rollout.scan import scan_model

NEW = 6
NO_EOS = {"eos_token_id": []}


class CompilingBackend(CPUBackend):
    """Declares that captures record compiled code and that compiling pays (as CUDA does)."""

    captures_compiled = True
    compiles_by_default = True


class ClaimsOnlyDefault(CPUBackend):
    """Declares that compiling pays without declaring that captures record compiled code."""

    compiles_by_default = True


def planned_compile(backend, **config) -> bool:
    model = tiny_model("llama")
    cfg = RolloutConfig(enable_graph_capture=True, backend=backend, **config)
    params = SamplingParams(max_new_tokens=NEW, pad_token_id=0)
    plan = plan_call(
        model,
        backend,
        cfg,
        params,
        None,
        batch_size=2,
        total_len=12,
        prompt_width=6,
        sampler=SamplerShape(),
        disabled_reason=None,
        scan=scan_model(model),
    )
    return plan.compiled


@pytest.mark.parametrize(
    ("backend", "setting", "compiles"),
    [
        (CompilingBackend(), None, True),
        (CompilingBackend(), False, False),
        (CompilingBackend(), True, True),
        (CPUBackend(), None, False),
        (ClaimsOnlyDefault(), None, False),
    ],
    ids=["declared-default", "opted-out", "asked", "cpu-default", "default-without-capability"],
)
def test_the_default_compiles_where_the_backend_declares_it_pays(backend, setting, compiles):
    assert planned_compile(backend, compile=setting) is compiles


def test_a_default_without_the_capture_capability_is_not_declared():
    caps = ClaimsOnlyDefault().capabilities
    assert not caps.compile_by_default
    assert CompilingBackend().capabilities.compile_by_default


def test_per_position_graphs_never_compile_by_default():
    assert not planned_compile(CompilingBackend(), per_position_graphs=True)
    with pytest.raises(ValueError, match="per_position_graphs"):
        RolloutConfig(enable_graph_capture=True, per_position_graphs=True, compile=True)


def test_the_cpu_default_config_captures_uncompiled_and_says_nothing_is_wrong():
    model = tiny_model("llama")
    ids, mask = prompts(3)
    engine = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=CPUBackend()))
    result = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS))
    stats = result.stats
    assert stats.path == "static_graph" and not stats.compiled and stats.fallback_reason is None
    assert stats.compile_cache is None and 0 < stats.warmup_s < stats.capture_s
    expected = run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS)
    assert torch.equal(result.sequences, expected.sequences)


def test_compile_without_graphs_is_refused_only_when_asked():
    RolloutConfig()  # the default leaves compile to the backend: nothing to refuse
    with pytest.raises(ValueError, match="enable_graph_capture=True"):
        RolloutConfig(compile=True)


def test_an_empty_compile_cache_setting_is_refused():
    with pytest.raises(ValueError, match="compile_cache"):
        RolloutConfig(compile_cache="")


def test_a_host_state_change_discards_compiled_code_before_compiling_again(monkeypatch):
    """dynamo does not guard on a module's forward hooks: a hook added after a compiled capture
    must not be served by the code compiled before it, so the holder resets dynamo before it
    compiles for a changed host state (``torch.compile`` is the identity here, so the CPU graph
    captures the "compiled" step)."""
    resets = []
    real_reset = torch.compiler.reset
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(1) or real_reset())
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    engine = RolloutEngine(
        model, RolloutConfig(enable_graph_capture=True, backend=CompilingBackend())
    )
    sampling = SamplingParams(max_new_tokens=NEW, **NO_EOS)
    first = engine.generate(ids, mask, sampling)
    assert first.stats.compiled and first.stats.path == "static_graph"
    engine.generate(ids, mask, sampling)  # the same host state: nothing to discard
    assert resets == []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out * 2)
    try:
        hooked = engine.generate(ids, mask, sampling)
        eager = run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS)
    finally:
        handle.remove()
    assert resets == [1] and hooked.stats.recapture_reason[0].startswith("host_state")
    assert torch.equal(hooked.sequences, eager.sequences)
    assert not torch.equal(hooked.sequences, first.sequences)


def test_tensor_parallel_steps_compile_only_when_asked():
    """Compiled tensor-parallel steps have not run anywhere: the default leaves them plain."""
    config = RolloutConfig(enable_graph_capture=True)
    object.__setattr__(config, "process_group", object())  # only its presence is read here
    assert not config.wants_compile(CompilingBackend())
    config.compile = True
    assert config.wants_compile(CompilingBackend())
