"""Whether captured steps compile: ``RolloutConfig.compile`` (``None`` by default) against the
backend's declared ``compile_by_default``; the CPU reference backend never compiles unasked."""

from __future__ import annotations

import pytest
import torch
from rollout_models import prompts, run, tiny_model

from graphcap.cpu import CPUBackend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.plan import plan_call
from graphcap.rollout.plan.scan import scan_model
from graphcap.rollout.sampling import SamplerShape
from graphcap.rollout.settings import CallSettings

NEW = 6
NO_EOS = {"eos_token_id": []}


class CompilingBackend(CPUBackend):
    """Declares that captures record compiled code and that compiling pays (as CUDA does)."""

    captures_compiled = True
    compile_by_default = True


class ClaimsOnlyDefault(CPUBackend):
    """Declares that compiling pays without declaring that captures record compiled code."""

    compile_by_default = True


def planned_compile(backend, model=None, **config) -> bool:
    model = model or tiny_model("llama")
    cfg = RolloutConfig(enable_graph_capture=True, backend=backend, **config)
    settings = CallSettings.of([SamplingParams(max_new_tokens=NEW, pad_token_id=0)])
    plan = plan_call(
        model,
        backend,
        cfg,
        settings,
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
    with pytest.raises(ValueError, match="enable_graph_capture"):
        RolloutConfig(compile=True, enable_graph_capture=False)


def test_an_empty_compile_cache_setting_is_refused():
    with pytest.raises(ValueError, match="compile_cache"):
        RolloutConfig(compile_cache="")


def test_a_path_names_the_compile_cache_directory(tmp_path):
    """``CompileCache`` takes a path, so the config does too (kept as a string)."""
    assert RolloutConfig(compile_cache=tmp_path).compile_cache == str(tmp_path)
    with pytest.raises(TypeError, match="compile_cache"):
        RolloutConfig(compile_cache=3)


def test_a_host_state_change_discards_compiled_code_before_compiling_again(monkeypatch):
    """dynamo does not guard on every host value the signature does: code compiled before a
    change (here the MLP's activation module swapped) must not serve the step after it, so the
    holder resets dynamo before it compiles for a changed host state (``torch.compile`` is the
    identity here, so the CPU graph captures the "compiled" step)."""
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
    mlp = model.model.layers[0].mlp
    mlp.act_fn = torch.nn.Tanh().train(mlp.training)
    changed = engine.generate(ids, mask, sampling)
    eager = run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS)
    assert resets == [1] and changed.stats.recapture_reason[0].startswith("host_state")
    assert changed.stats.compiled
    assert torch.equal(changed.sequences, eager.sequences)
    assert not torch.equal(changed.sequences, first.sequences)


def _hook(kind: str, mlp: torch.nn.Module):
    def scale(module, args, output):
        return output * 2.5 if module is mlp else None

    if kind == "forward_hook":
        return mlp.register_forward_hook(scale)
    if kind == "forward_pre_hook":
        return mlp.register_forward_pre_hook(lambda module, args: (args[0] * 2.5,))
    return torch.nn.modules.module.register_module_forward_hook(scale)


@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook", "global_hook"])
def test_a_hooked_model_is_captured_uncompiled_with_the_reason(monkeypatch, kind):
    """On the H200 compiled captures of a hooked model differed from eager (plan's
    compile_refusal): a live forward hook, added before the first call or between calls, gets
    an uncompiled capture that equals eager, and the stats say why."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(3)
    engine = RolloutEngine(
        model, RolloutConfig(enable_graph_capture=True, backend=CompilingBackend())
    )
    sampling = SamplingParams(max_new_tokens=NEW, **NO_EOS)
    assert engine.generate(ids, mask, sampling).stats.compiled
    handle = _hook(kind, model.model.layers[0].mlp)
    try:
        hooked = engine.generate(ids, mask, sampling)
        eager = run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS)
    finally:
        handle.remove()
    where = "global module forward hooks" if kind == "global_hook" else "model.layers.0.mlp"
    assert hooked.stats.path == "static_graph" and not hooked.stats.compiled
    assert hooked.stats.recapture_reason[0].startswith("host_state")
    assert f"forward hooks ({where})" in hooked.stats.fallback_reason
    assert torch.equal(hooked.sequences, eager.sequences)
    again = engine.generate(ids, mask, sampling)  # the hook removed: compiled again
    assert again.stats.compiled and again.stats.fallback_reason is None


def test_an_inert_hook_does_not_turn_compiling_off():
    """transformers' ``enable_input_require_grads`` hook (gradient checkpointing with PEFT)
    issues no device work: the step still compiles."""
    model = tiny_model("llama", fresh=True)
    model.enable_input_require_grads()
    assert planned_compile(CompilingBackend(), model=model)


def test_tensor_parallel_steps_compile_only_when_asked():
    """Compiled tensor-parallel steps have not run anywhere: the default leaves them plain."""
    config = RolloutConfig(enable_graph_capture=True)
    object.__setattr__(config, "process_group", object())  # only its presence is read here
    assert not config.wants_compile(CompilingBackend())
    config.compile = True
    assert config.wants_compile(CompilingBackend())
