"""The plan honours what a backend declares and what a call asks, and the engine records why."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from fakes import NoCollectivesGraphBackend, NoGraphBackend, NoRngGraphBackend
from rollout_models import (
    EOS,
    FAMILIES,
    generate_padded,
    make_engine,
    prompts,
    run,
    tiny_model,
)
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from graphcap.cpu import CPUBackend
from graphcap.errors import CaptureFallbackWarning
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.cache.cache import put_columns
from graphcap.rollout.holder import GraphHolder
from graphcap.rollout.paths import ROLLOUTS
from graphcap.rollout.plan import DecodePath
from graphcap.rollout.plan import plan as plan_module
from graphcap.rollout.plan.regions import (
    BOOKKEEPING_OPTIONS,
    ROTARY,
    compiled_bookkeeping,
    compiled_regions,
    regions_to_compile,
    rotary_functions,
)

NEW = 6
NO_EOS = {"eos_token_id": []}


def test_backend_without_rng_in_graph_runs_sampled_calls_eagerly_and_greedy_on_graphs():
    model = tiny_model("llama")
    ids, mask = prompts(3)
    sampled = {"do_sample": True, "top_k": 8, "max_new_tokens": NEW, "seed": 3, **NO_EOS}
    result = run(model, ids, mask, True, backend=NoRngGraphBackend(), **sampled)
    assert result.stats.path == "eager" and result.stats.captures == 0
    assert "rng_in_graph=False" in result.stats.fallback_reason
    assert torch.equal(result.sequences, run(model, ids, mask, False, **sampled).sequences)
    greedy = run(model, ids, mask, True, backend=NoRngGraphBackend(), max_new_tokens=NEW)
    assert greedy.stats.path == "static_graph"


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("backend_class", [NoCollectivesGraphBackend, CPUBackend])
def test_collectives_in_graph_decides_tensor_parallel_graphs(one_rank_group, backend_class):
    model = tiny_model("gpt2")
    ids, mask = prompts(2)
    engine = make_engine(model, backend=backend_class(), process_group=one_rank_group)
    result = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS))
    if backend_class.collectives_in_graph:
        assert result.stats.path == "static_graph"
    else:
        assert result.stats.path == "eager"
        assert "collectives_in_graph=False" in result.stats.fallback_reason
    assert torch.equal(
        result.sequences, run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS).sequences
    )


def test_one_new_token_has_no_step_and_says_so():
    model = tiny_model("llama")
    ids, mask = prompts(2)
    result = run(model, ids, mask, True, max_new_tokens=1)
    assert result.stats.path == "eager" and result.stats.captures == 0
    assert "max_new_tokens=1" in result.stats.fallback_reason
    total = ids.shape[1] + 1
    assert torch.equal(result.sequences, generate_padded(model, ids, mask, total, max_new_tokens=1))


CALLS: list[str] = []


def _noting_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA that notes each call (Python runs at warm-up and capture only, never on replay)."""
    CALLS.append("graph-attention")
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("graphcap_test_graph_attention", _noting_sdpa)


class GraphAttentionBackend(CPUBackend):
    graph_attention = "graphcap_test_graph_attention"


@pytest.mark.parametrize("choice", ["auto", None])
def test_backend_graph_attention_runs_in_captured_steps_only(choice):
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(3)
    engine = make_engine(model, backend=GraphAttentionBackend(), graph_attention=choice)
    CALLS.clear()
    result = engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS))
    layers = model.config.num_hidden_layers
    if choice == "auto":
        assert result.stats.attention == "graphcap_test_graph_attention"
        assert ["graph-attention"] * (2 * layers) == CALLS  # warm-up and capture
    else:
        assert result.stats.attention == "sdpa" and CALLS == []
    # the model's own is restored (private: transformers has no public getter for it)
    assert model.config._attn_implementation == "sdpa"
    eager = run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS)
    assert eager.stats.attention == "sdpa"
    assert torch.equal(result.sequences, eager.sequences)
    CALLS.clear()
    engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS))
    assert CALLS == []  # replays only


def test_gradient_checkpointing_in_train_mode_rolls_out_like_generate_in_eval():
    """Right after a training step: checkpointing on, model in train(). (generate() itself
    drops its cache in that state on transformers 5.17 and continues from the last token alone,
    so the reference is generate() before training mode.)"""
    model = tiny_model("llama", fresh=True)  # no dropout: train() changes no value
    ids, mask = prompts(3)
    total = ids.shape[1] + NEW
    expected = generate_padded(model, ids, mask, total, max_new_tokens=NEW, eos_token_id=EOS)
    model.gradient_checkpointing_enable()
    model.train()
    for graph in (False, True):
        result = run(model, ids, mask, graph, max_new_tokens=NEW)
        assert torch.equal(result.sequences, expected), graph
    assert model.training and model.is_gradient_checkpointing


def test_compile_is_refused_for_graphs_where_the_backend_cannot_capture_compiled_code():
    model = tiny_model("llama")
    ids, mask = prompts(3)
    config = RolloutConfig(enable_graph_capture=True, backend=CPUBackend(), compile=True)
    result = RolloutEngine(model, config).generate(ids, mask, SamplingParams(max_new_tokens=NEW))
    assert result.stats.path == "eager" and not result.stats.compiled
    assert "captures_compiled=False" in result.stats.fallback_reason
    assert torch.equal(result.sequences, run(model, ids, mask, False, max_new_tokens=NEW).sequences)


class CompiledCaptureBackend(CPUBackend):
    """Declares (wrongly, for the CPU reference graph) that captures record compiled code."""

    captures_compiled = True


#: The inductor options OptionsBackend gives compiled regions.
COMPILE_OPTIONS = {"combo_kernels": True}


class OptionsBackend(CompiledCaptureBackend):
    """Gives compiled regions inductor options (``Backend.compile_options``)."""

    def compile_options(self) -> dict[str, object]:
        return dict(COMPILE_OPTIONS)


class SettingsBackend(OptionsBackend):
    """Records when its compiled-capture settings are entered and left, and its captures."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    @contextlib.contextmanager
    def compiled_capture_context(self) -> Iterator[None]:
        self.events.append("enter")
        try:
            yield
        finally:
            self.events.append("exit")

    def capture_to_graph(self, graph, **kwargs):
        self.events.append("capture")
        return super().capture_to_graph(graph, **kwargs)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "plain"])
def test_only_compiled_captures_run_under_the_backends_settings(monkeypatch, compiled):
    """A compiled capture (its warm-up and capture) runs inside the backend's
    ``compiled_capture_context``; a plain capture never does, so it stays bit-equal to eager
    steps."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager"))
    backend = SettingsBackend()
    config = RolloutConfig(enable_graph_capture=True, backend=backend, compile=compiled)
    ids, mask = prompts(2)
    with warnings.catch_warnings():  # the CPU reference graph refuses compiled regions
        warnings.simplefilter("ignore", CaptureFallbackWarning)
        RolloutEngine(tiny_model("llama", fresh=True), config).generate(
            ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS)
        )
    assert backend.events == (["enter", "capture", "exit"] if compiled else ["capture"])


@pytest.mark.parametrize("slots", [None, 2], ids=["static", "continuous"])
def test_compile_runs_the_compiled_blocks_in_the_capture_only(monkeypatch, slots):
    """The CPU reference graph refuses compiled regions at capture: the refusal proves the
    capture ran the compiled blocks, each compiled with the backend's inductor options, and the
    call still completes exactly, eagerly."""
    compiled: list[object] = []
    options: list[object] = []
    real_compile = torch.compile

    def noting_compile(fn, **kwargs):  # dynamo without inductor: no C++ build in a test
        compiled.append(fn)
        options.append(kwargs.pop("options", None))
        return real_compile(fn, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", noting_compile)
    model = tiny_model("llama", fresh=True)
    blocks = regions_to_compile(model)
    ids, mask = prompts(3)
    config = RolloutConfig(
        enable_graph_capture=True,
        backend=OptionsBackend(),
        compile=True,
        continuous_batch_size=slots,
    )
    with pytest.warns(CaptureFallbackWarning):
        result = RolloutEngine(model, config).generate(
            ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS)
        )
    rotary = rotary_functions(model)
    *regions, prepare, finish = compiled
    assert [fn.__self__ for fn in regions if hasattr(fn, "__self__")] == blocks
    functions = [fn for fn in regions if not hasattr(fn, "__self__")]
    assert functions == [put_columns] + [fn for _, fn in rotary]  # K/V writes, rotary
    step = prepare.__self__
    assert (prepare.__name__, finish.__name__) == ("prepare", "finish")
    assert finish.__self__ is step and not {"prepare", "finish"} & set(vars(step))  # restored
    bookkeeping = COMPILE_OPTIONS | BOOKKEEPING_OPTIONS
    assert options == [COMPILE_OPTIONS] * len(regions) + [bookkeeping] * 2
    assert all(getattr(module, ROTARY) is fn for module, fn in rotary)  # restored
    assert result.stats.path.endswith("eager") and not result.stats.compiled
    assert "compiled" in result.stats.fallback_reason, result.stats.fallback_reason
    assert not any("forward" in vars(m) for m in model.modules())  # own forwards again
    expected = run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS)
    assert torch.equal(result.sequences, expected.sequences)


@pytest.mark.parametrize(
    "sampling",
    [
        {},
        {"return_logprobs": True, "repetition_penalty": 1.3, "min_new_tokens": 4},
        {"do_sample": True, "top_k": 8, "temperature": 0.8, "return_logprobs": True},
        {"do_sample": True, "top_p": 0.9, "seed": 5},
    ],
    ids=["greedy", "penalty-min-new-logprobs", "sampled", "seeded"],
)
def test_the_compiled_bookkeeping_commits_what_the_eager_one_does(monkeypatch, sampling):
    """Every step of a call prepares its masks and finishes through the compiled ``prepare`` and
    ``finish`` (dynamo and AOT autograd: their in-place writes to the step's masks and state
    are functionalised, then written back; random draws stay eager's): tokens, log-probs and
    the generator's state equal the plain call's."""
    options: list[object] = []
    real_compile = torch.compile

    def aot_compile(fn, **kwargs):  # no inductor: no C++ build in a test
        options.append(kwargs.pop("options", None))
        return real_compile(fn, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch, "compile", aot_compile)
    real_step_for = GraphHolder.step_for
    swaps = contextlib.ExitStack()

    def compiled_step_for(holder, *args):
        step = real_step_for(holder, *args)
        if "finish" not in vars(step):
            swaps.enter_context(compiled_bookkeeping(step))
        return step

    model = tiny_model("llama")
    ids, mask = prompts(3)
    params = {"max_new_tokens": NEW, **NO_EOS, **sampling}
    outs, states = [], []
    for compiled in (False, True):
        if compiled:
            monkeypatch.setattr(GraphHolder, "step_for", compiled_step_for)
        torch.manual_seed(11)
        with swaps:
            outs.append(run(model, ids, mask, False, **params))
        states.append(torch.get_rng_state())
    assert options == [BOOKKEEPING_OPTIONS] * 2 and BOOKKEEPING_OPTIONS["fallback_random"]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    if sampling.get("return_logprobs"):
        assert torch.equal(outs[0].logprobs, outs[1].logprobs)
    assert torch.equal(states[0], states[1])


#: What compile=True compiles in each tiny family: block classes (two decoder layers, the
#: decoder stack's final norm and rotary embedding) and whether the attention calls a rotary
#: function.
REGIONS = {
    "gpt2": ({"GPT2Block": 2, "LayerNorm": 1}, False),
    "llama": ({"LlamaDecoderLayer": 2, "LlamaRMSNorm": 1, "LlamaRotaryEmbedding": 1}, True),
    "qwen2": ({"Qwen2DecoderLayer": 2, "Qwen2RMSNorm": 1, "Qwen2RotaryEmbedding": 1}, True),
    "opt": ({"OPTDecoderLayer": 2, "LayerNorm": 1}, False),
    "mistral": (
        {"MistralDecoderLayer": 2, "MistralRMSNorm": 1, "MistralRotaryEmbedding": 1},
        True,
    ),
}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_compiled_layers_leave_the_attention_out_and_share_their_frames(family, monkeypatch):
    """Each decoder layer compiles as the code before and after its attention: frames every
    layer shares (as many graphs for four layers as for two), none holding the attention."""
    graphs: list[torch.fx.GraphModule] = []

    def recorded(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=recorded))
    counts = []
    for layers in (2, 4):
        torch.compiler.reset()
        graphs.clear()
        model = tiny_model(family, fresh=True, num_hidden_layers=layers)
        ids, mask = prompts(1)
        with torch.no_grad(), compiled_regions(model):
            model(ids, attention_mask=mask)
        counts.append(len(graphs))
        code = "".join(gm.code for gm in graphs)
        assert "scaled_dot_product_attention" not in code and "softmax" not in code
        assert any("layer_norm" in gm.code or "rsqrt" in gm.code for gm in graphs)  # the norms
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("family", FAMILIES)
def test_compile_regions_are_the_blocks_beside_attention(family):
    model = tiny_model(family)
    blocks, rotary = REGIONS[family]
    names = [type(b).__name__ for b in regions_to_compile(model)]
    assert {n: names.count(n) for n in names} == blocks
    assert [fn.__name__ for _, fn in rotary_functions(model)] == (
        ["apply_rotary_pos_emb"] if rotary else []
    )


def test_compile_without_blocks_to_compile_captures_uncompiled_and_says_why(monkeypatch):
    monkeypatch.setattr(plan_module, "regions_to_compile", lambda model: [])
    model = tiny_model("llama")
    ids, mask = prompts(3)
    config = RolloutConfig(
        enable_graph_capture=True, backend=CompiledCaptureBackend(), compile=True
    )
    result = RolloutEngine(model, config).generate(
        ids, mask, SamplingParams(max_new_tokens=NEW, **NO_EOS)
    )
    assert result.stats.path == "static_graph" and not result.stats.compiled
    assert "no decoder block to compile" in result.stats.fallback_reason
    expected = run(model, ids, mask, False, max_new_tokens=NEW, **NO_EOS)
    assert torch.equal(result.sequences, expected.sequences)


def test_compile_needs_graphs_and_excludes_per_position_graphs():
    with pytest.raises(ValueError, match="enable_graph_capture"):
        RolloutConfig(compile=True, enable_graph_capture=False)
    assert RolloutConfig(compile=True).compile  # the default captures where the backend can
    with pytest.raises(ValueError, match="per_position_graphs"):
        RolloutConfig(enable_graph_capture=True, per_position_graphs=True, compile=True)


def test_an_unknown_graph_attention_is_refused_before_any_call():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"graph_attention='no-such'.*registered: eager"):
        RolloutEngine(model, RolloutConfig(enable_graph_capture=True, graph_attention="no-such"))
    for fine in ("auto", None, "eager", "sdpa"):
        RolloutEngine(model, RolloutConfig(enable_graph_capture=True, graph_attention=fine))


def test_each_path_is_its_stats_string_with_one_eager_fallback_and_one_server():
    assert [str(p) for p in DecodePath] == [
        "eager",
        "static_graph",
        "per_position_graph",
        "continuous_eager",
        "continuous_graph",
    ]
    assert set(ROLLOUTS) == set(DecodePath)
    for path in DecodePath:
        fallback = path.eager_fallback
        assert not fallback.is_graph and fallback.continuous == path.continuous
        assert ROLLOUTS[fallback] is ROLLOUTS[path]
    asked = {
        DecodePath.EAGER: RolloutConfig(enable_graph_capture=False),
        DecodePath.STATIC_GRAPH: RolloutConfig(),
        DecodePath.PER_POSITION_GRAPH: RolloutConfig(per_position_graphs=True),
        DecodePath.CONTINUOUS_EAGER: RolloutConfig(
            continuous_batch_size=2, enable_graph_capture=False
        ),
        DecodePath.CONTINUOUS_GRAPH: RolloutConfig(continuous_batch_size=2),
    }
    assert all(DecodePath.asked(config, CPUBackend()) is path for path, config in asked.items())
    # the default asks for graphs where the backend can capture
    assert DecodePath.asked(RolloutConfig(), NoGraphBackend()) is DecodePath.EAGER
    assert DecodePath.asked(RolloutConfig(enable_graph_capture=True), NoGraphBackend()).is_graph


def test_stats_report_the_path_as_a_plain_string():
    model = tiny_model("llama")
    ids, mask = prompts(2)
    stats = run(model, ids, mask, True, max_new_tokens=NEW).stats
    assert type(stats.path) is str and stats.path == DecodePath.STATIC_GRAPH
    assert json.loads(json.dumps(dataclasses.asdict(stats)))["path"] == "static_graph"
    assert "path='static_graph'" in repr(stats)
