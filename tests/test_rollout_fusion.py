"""RolloutConfig(fuse_projections=True): joined q/k/v and gate/up products, on the CPU graph."""

from __future__ import annotations

import pytest
import torch
from rollout_models import FAMILIES, distinct_tokens_per_row, make_engine, prompts, run, tiny_model

from graphcap.cpu import CPUBackend
from graphcap.rollout import SamplingParams
from graphcap.rollout.plan.fusion import JoinedGroup, joinable_groups

NEW = 12
NO_EOS = {"eos_token_id": [], "max_new_tokens": NEW}
#: groups per layer: q/k/v and gate/up on the Llama-like families, q/k/v on OPT, none on GPT-2
#: (its c_attn is already one product).
GROUPS_PER_LAYER = {"gpt2": 0, "llama": 2, "qwen2": 2, "mistral": 2, "opt": 1}


def joined(model, ids, mask, graph: bool = True, **sampling):
    engine = make_engine(model, graph, fuse_projections=True)
    return engine, engine.generate(ids, mask, SamplingParams(**{**NO_EOS, **sampling}))


def linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 4])
def test_joined_graph_equals_eager_and_the_unjoined_model(family, batch):
    model = tiny_model(family, fresh=True)
    ids, mask = prompts(batch)
    expected = run(model, ids, mask, False, **NO_EOS, return_logprobs=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _, result = joined(model, ids, mask, return_logprobs=True)
    assert result.stats.path == "static_graph" and result.stats.replays > 0
    assert result.stats.fused_projections == GROUPS_PER_LAYER[family] * 2
    assert torch.equal(result.sequences, expected.sequences)
    assert torch.allclose(result.logprobs, expected.logprobs, atol=1e-5, rtol=0)
    assert distinct_tokens_per_row(result)
    _, eager = joined(model, ids, mask, graph=False)
    assert torch.equal(eager.sequences, expected.sequences)
    after = model.state_dict()  # the parameters are views now, with the same values
    assert all(torch.equal(state[k], after[k]) for k in state)
    assert not any("forward" in vars(lin) for lin in linears(model))  # own forwards again


def test_sampled_and_logprobs_equal_the_unjoined_model():
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(3)
    sampling = {"do_sample": True, "temperature": 0.9, "top_k": 20, "seed": 5}
    plain = run(model, ids, mask, False, **NO_EOS, **sampling, return_logprobs=True)
    _, result = joined(model, ids, mask, **sampling, return_logprobs=True)
    assert torch.equal(result.sequences, plain.sequences)
    assert torch.allclose(result.logprobs, plain.logprobs)


def test_parameters_are_views_of_one_buffer_and_in_place_updates_reach_the_graph():
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    engine, first = joined(model, ids, mask)
    attn = model.model.layers[0].self_attn
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    with torch.no_grad():  # a trainer's in-place step on every parameter
        for p in model.parameters():
            p.mul_(0.9)
    second = engine.generate(ids, mask, SamplingParams(**NO_EOS))
    assert second.stats.captures == 1 and not second.stats.captured  # replayed, not recaptured
    expected = run(model, ids, mask, False, **NO_EOS)
    assert torch.equal(second.sequences, expected.sequences)
    assert not torch.equal(second.sequences, first.sequences)


def test_replaced_storage_is_joined_again():
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    engine, _ = joined(model, ids, mask)
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        mlp.up_proj.weight.data = mlp.up_proj.weight.data.clone() * 1.5  # new storage
    before = mlp.gate_proj.weight.untyped_storage().data_ptr()
    result = engine.generate(ids, mask, SamplingParams(**NO_EOS))
    # joined again into the same buffer: the graph reads it, so nothing is captured again
    assert not result.stats.captured and result.stats.recapture_reason == []
    assert mlp.up_proj.weight.data_ptr() != mlp.gate_proj.weight.data_ptr()
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == before
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == (
        mlp.up_proj.weight.untyped_storage().data_ptr()
    )
    expected = run(model, ids, mask, False, **NO_EOS)
    assert torch.equal(result.sequences, expected.sequences)


def test_wrapped_or_mismatched_layers_are_left_alone():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", fresh=True)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    groups = joinable_groups(lora)
    assert groups and all(names[0] is not None for names in groups)
    assert all(type(g[0]).__name__ == "Linear" and len(g) == 2 for g in groups)  # gate/up only
    ids, mask = prompts(2)
    expected = run(lora, ids, mask, False, **NO_EOS)
    _, result = joined(lora, ids, mask)
    assert result.stats.fused_projections == 2
    assert torch.equal(result.sequences, expected.sequences)


def test_a_later_layer_called_on_another_input_computes_its_own_product():
    linears_ = [torch.nn.Linear(8, n, bias=True) for n in (4, 6)]
    group = JoinedGroup(linears_)
    with torch.no_grad():
        expected = [lin(torch.ones(2, 8)) for lin in linears_]
        group.join()
        (_, first_fwd), (second, second_fwd) = group.swaps()
        x, other = torch.ones(2, 8), torch.zeros(2, 8)
        assert torch.allclose(first_fwd(x), expected[0])
        assert torch.allclose(second_fwd(other), F_linear(other, second))  # not x's slice
        assert torch.allclose(second_fwd(x), expected[1])  # x's slice


def F_linear(x, linear):
    return torch.nn.functional.linear(x, linear.weight, linear.bias)


@pytest.mark.parametrize(
    "config, sampling, path",
    [
        ({"continuous_batch_size": 2}, {}, "continuous_graph"),
        ({"per_position_graphs": True}, {"min_new_tokens": NEW}, "per_position_graph"),
    ],
    ids=["continuous", "per_position"],
)
def test_every_graph_path_runs_joined_and_equals_the_unjoined_eager_loop(config, sampling, path):
    model = tiny_model("qwen2", fresh=True)
    ids, mask = prompts(5)
    expected = run(model, ids, mask, False, **NO_EOS, **sampling)
    engine = make_engine(model, True, fuse_projections=True, **config)
    result = engine.generate(ids, mask, SamplingParams(**NO_EOS, **sampling))
    assert result.stats.path == path and result.stats.replays > 0, result.stats.fallback_reason
    assert result.stats.fused_projections == 4
    assert torch.equal(result.sequences, expected.sequences)


def test_parameters_gathered_in_forward_are_never_joined():
    model = tiny_model("llama", fresh=True)
    model.register_parameter("placeholder", torch.nn.Parameter(torch.empty(0)))  # as ZeRO-3
    ids, mask = prompts(2)
    attn = model.model.layers[0].self_attn
    before = attn.q_proj.weight.data_ptr(), attn.k_proj.weight.data_ptr()
    _, result = joined(model, ids, mask)
    assert result.stats.path == "eager" and "placeholder" in result.stats.fallback_reason
    assert result.stats.fused_projections == 0
    assert (attn.q_proj.weight.data_ptr(), attn.k_proj.weight.data_ptr()) == before
    assert not any("forward" in vars(lin) for lin in linears(model))


def test_parameters_a_sharding_library_replaces_every_round_are_never_joined():
    """ZeRO-3 parameters gathered around the call are resident, but the library frees the
    storage a join would move: they run unjoined, on graphs."""
    model = tiny_model("llama", fresh=True)
    for i, p in enumerate(model.parameters()):
        p.ds_id = i
    ids, mask = prompts(2)
    attn = model.model.layers[0].self_attn
    before = attn.q_proj.weight.data_ptr(), attn.k_proj.weight.data_ptr()
    _, result = joined(model, ids, mask)
    assert result.stats.path == "static_graph" and result.stats.fused_projections == 0
    assert result.stats.weights == "copy"
    assert (attn.q_proj.weight.data_ptr(), attn.k_proj.weight.data_ptr()) == before


class JoiningBackend(CPUBackend):
    """Declares that joining projections pays in captured steps (as CUDA does)."""

    fuse_projections_by_default = True


class EagerJoiningBackend(JoiningBackend):
    """Claims the default without being able to capture: the claim is not a capability."""

    graph_capture = False

    def create_graph(self):
        return None


@pytest.mark.parametrize(
    ("backend", "graph", "setting", "groups"),
    [
        (JoiningBackend(), True, None, 4),
        (JoiningBackend(), True, False, 0),
        (JoiningBackend(), False, None, 0),
        (JoiningBackend(), False, True, 4),
        (CPUBackend(), True, None, 0),
        (CPUBackend(), True, True, 4),
        (EagerJoiningBackend(), True, None, 0),
    ],
    ids=[
        "declared-default",
        "opted-out",
        "eager-engine-default",
        "eager-engine-asked",
        "cpu-default",
        "cpu-asked",
        "no-capture",
    ],
)
def test_the_default_joins_where_the_backend_declares_it_pays(backend, graph, setting, groups):
    """``fuse_projections=None`` joins in graph engines on a backend that declares
    ``fuse_projections_by_default``; ``True``/``False`` decide alone; either way the tokens
    and log-probs are the unjoined eager loop's."""
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    expected = run(model, ids, mask, False, **NO_EOS, return_logprobs=True)
    engine = make_engine(model, graph, backend=backend, fuse_projections=setting)
    result = engine.generate(ids, mask, SamplingParams(**NO_EOS, return_logprobs=True))
    assert result.stats.fused_projections == groups
    assert backend.capabilities.fuse_projections_by_default is (
        isinstance(backend, JoiningBackend) and backend.capabilities.graph_capture
    )
    assert torch.equal(result.sequences, expected.sequences)
    assert torch.allclose(result.logprobs, expected.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["back_to_back", "reversed"])
def test_parameters_viewing_another_librarys_buffer_are_joined_only_where_they_lie(layout):
    """DeepSpeed ZeRO-1/2 and FSDP make parameters views of their own flat buffer and write
    updates there: moving them would leave the model reading stale copies. Where the group
    lies back to back in that buffer it runs joined right there (nothing copied or moved),
    else unjoined; either way an update through the flat buffer reaches the next call."""
    model = tiny_model("llama", fresh=True)
    attention = model.model.layers[0].self_attn
    group = [attention.q_proj, attention.k_proj, attention.v_proj]
    order = group if layout == "back_to_back" else group[::-1]
    flat = torch.cat([lin.weight.detach().flatten() for lin in order])
    start = 0
    for lin in order:  # as a flat-parameter library lays them out
        lin.weight.data = flat[start : start + lin.weight.numel()].view_as(lin.weight)
        start += lin.weight.numel()
    where = [lin.weight.data_ptr() for lin in group]
    ids, mask = prompts(2)
    engine, result = joined(model, ids, mask)
    layers = len(model.model.layers)
    expected = 2 * layers if layout == "back_to_back" else 2 * layers - 1
    assert result.stats.fused_projections == expected
    assert [lin.weight.data_ptr() for lin in group] == where  # nothing moved
    assert torch.equal(result.sequences, run(model, ids, mask, False, **NO_EOS).sequences)
    with torch.no_grad():
        flat.mul_(-1.0)  # the library's optimizer step
    after = engine.generate(ids, mask, SamplingParams(**NO_EOS))
    assert not after.stats.captured
    assert torch.equal(after.sequences, run(model, ids, mask, False, **NO_EOS).sequences)
    assert not torch.equal(after.sequences, result.sequences)


def test_a_second_engine_joins_where_the_first_left_the_groups():
    """Two engines on one model (the drop-in beside an engine, a benchmark's cases): the
    second finds every group joined in the first's buffers and runs joined there, copying
    nothing; both stay equal to the unjoined eager loop after an in-place update."""
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    first, one = joined(model, ids, mask)
    where = {name: p.data_ptr() for name, p in model.named_parameters()}
    second, two = joined(model, ids, mask)
    assert two.stats.fused_projections == one.stats.fused_projections > 0
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == where
    assert torch.equal(two.sequences, one.sequences)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    expected = run(model, ids, mask, False, **NO_EOS).sequences
    for engine in (first, second):
        again = engine.generate(ids, mask, SamplingParams(**NO_EOS))
        assert not again.stats.captured and torch.equal(again.sequences, expected)


def test_a_joined_model_saves_and_loads_as_before(tmp_path):
    """Joined parameters are disjoint views of one buffer: ``save_pretrained`` (safetensors)
    writes each as its own tensor and the saved model loads with the same weights."""
    model = tiny_model("llama", fresh=True)
    ids, mask = prompts(2)
    _, result = joined(model, ids, mask)
    assert result.stats.fused_projections > 0
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    saved, before = loaded.state_dict(), model.state_dict()
    assert saved.keys() == before.keys()
    assert all(torch.equal(saved[k], before[k]) for k in before)
