"""Graphs on a model sharded by transformers' own tensor parallelism (2 gloo ranks on CPU).

The tiny Llama is saved once, then each rank loads it with
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2, tp_plan="auto"))``: the
attention and MLP projections become DTensor shards, o_proj / down_proj end in a
``dist.all_reduce`` and lm_head gathers its columns (a functional all-gather), so every decode
step holds real collectives. A replay that skipped one, or ranks that diverged, give wrong
tokens or a gloo error / timeout. All scenarios run in one spawn of two processes.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from fakes import NoCollectivesGraphBackend
from rollout_models import make_engine, prompts, run, tiny_model
from spawned_ranks import WORLD, records, spawn_ranks
from torch.distributed.tensor import DTensor

from graphcap.cpu import CPUBackend
from graphcap.cpu.graph import CPUGraph
from graphcap.errors import GraphCaptureError
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

DEADLINE_S = 180
NO_EOS = {"eos_token_id": []}

pytestmark = pytest.mark.skipif(
    not dist.is_available() or torch.accelerator.is_available(),
    reason="transformers builds the tensor-parallel mesh on the accelerator when there is one",
)


def _tp_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        path,
        distributed_config=DistributedConfig(tp_size=WORLD, tp_plan="auto"),
        attn_implementation="sdpa",
        dtype=torch.float32,
    ).eval()
    model.generation_config.pad_token_id = 0
    return model


def _engine(model, backend=None, **config) -> RolloutEngine:
    return RolloutEngine(
        model,
        RolloutConfig(
            enable_graph_capture=True,
            backend=backend or CPUBackend(),
            process_group=dist.group.WORLD,
            **config,
        ),
    )


def _sharded(rank: int, model) -> dict:
    """(0) the load really sharded the projections and kept the shards resident."""
    q = model.model.layers[0].self_attn.q_proj.weight
    return {"type": type(q).__name__, "local": tuple(q.to_local().shape), "full": tuple(q.shape)}


def _same(rank: int, model) -> dict:
    """(a) graph == eager on the shard, == the unsharded model, on both paths."""
    ids, mask = prompts(3)
    greedy = {"max_new_tokens": 8, **NO_EOS}
    sampled = {"do_sample": True, "top_k": 10, "seed": 3, **greedy}
    out = {}
    for name, params, config in (
        ("greedy", greedy, {}),
        ("sampled", sampled, {}),
        ("continuous", greedy, {"continuous_batch_size": 2}),
    ):
        graph = _engine(model, **config).generate(ids, mask, SamplingParams(**params))
        eager = RolloutEngine(
            model,
            RolloutConfig(
                backend=CPUBackend(),
                process_group=dist.group.WORLD,
                enable_graph_capture=False,
                **config,
            ),
        ).generate(ids, mask, SamplingParams(**params))
        whole = run(tiny_model("llama"), ids, mask, False, **params)
        out[name] = {
            "path": graph.stats.path,
            "replays": graph.stats.replays,
            "equal": torch.equal(graph.sequences, eager.sequences),
            "whole_equal": torch.equal(graph.sequences, whole.sequences),
            "sequences": graph.sequences,
        }
    return out


def _early(rank: int, model) -> dict:
    """(b) rank 0's rows all end at their third token, rank 1's never end. Compared with the
    sharded eager run: over 20 tokens the shards' summation order may flip an argmax against
    the unsharded model."""
    ids, mask = prompts(3)
    new, width = 20, ids.shape[1]
    probe = run(tiny_model("llama"), ids, mask, False, max_new_tokens=new, **NO_EOS)
    eos = sorted({int(t) for t in probe.sequences[:, width + 2]}) if rank == 0 else []
    params = SamplingParams(max_new_tokens=new, eos_token_id=eos)
    sharded = _engine(model, eos_check_interval=4).generate(ids, mask, params)
    eager = RolloutEngine(
        model,
        RolloutConfig(
            backend=CPUBackend(),
            process_group=dist.group.WORLD,
            eos_check_interval=4,
            enable_graph_capture=False,
        ),
    ).generate(ids, mask, params)
    # the unsharded model alone: how many steps this rank would take without its peer
    alone = make_engine(tiny_model("llama"), eos_check_interval=4).generate(ids, mask, params)
    return {
        "steps": sharded.stats.steps,
        "eager_steps": eager.stats.steps,
        "alone_steps": alone.stats.steps,
        "equal": torch.equal(sharded.sequences, eager.sequences),
        "path": sharded.stats.path,
    }


def _recapture(rank: int, model) -> dict:
    """(c) the second call changes a signature member (the pad id) on rank 1 only."""
    ids, mask = prompts(3)
    engine = _engine(model)
    same = SamplingParams(max_new_tokens=6, **NO_EOS)
    changed = SamplingParams(max_new_tokens=6, pad_token_id=3, **NO_EOS)
    first = engine.generate(ids, mask, same)
    second = engine.generate(ids, mask, changed if rank == 1 else same)
    third = engine.generate(ids, mask, changed if rank == 1 else same)
    # a new shard (new local storage) for one weight on every rank: the graph read the old one
    proj = model.model.layers[0].self_attn.q_proj
    old = proj.weight
    proj.weight = torch.nn.Parameter(
        DTensor.from_local(old.to_local().clone(), old.device_mesh, old.placements),
        requires_grad=False,
    )
    try:
        fourth = engine.generate(ids, mask, changed if rank == 1 else same)
    finally:
        proj.weight = old
    return {
        "new_shard_reason": fourth.stats.recapture_reason,
        "new_shard_equal": torch.equal(third.sequences, fourth.sequences),
        "captures": third.stats.captures,
        "reason": second.stats.recapture_reason,
        "path": second.stats.path,
        "third_captured": third.stats.captured,
        "equal": torch.equal(first.sequences, second.sequences),
        "third_equal": torch.equal(first.sequences, third.sequences),
    }


def _failure(rank: int, model) -> dict:
    """(d) rank 1's capture does a host read in the middle of the forward (after layer 0's
    collectives); rank 0 captures fine. Capture issues no collective, so rank 0 is not left
    waiting inside the forward: both meet at the agreement and finish eagerly."""
    backend = CPUBackend()

    def host_read_during_capture(module, args, output):
        if rank == 1 and backend.is_current_stream_capturing():
            output[0].sum().item()

    hook = model.model.layers[1].register_forward_hook(host_read_during_capture)
    ids, mask = prompts(3)
    params = SamplingParams(max_new_tokens=6, **NO_EOS)
    try:
        engine = _engine(model, backend=backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            failed = engine.generate(ids, mask, params)
            later = engine.generate(ids, mask, params)
    finally:
        hook.remove()
    whole = run(tiny_model("llama"), ids, mask, False, max_new_tokens=6, **NO_EOS)
    return {
        "path": failed.stats.path,
        "reason": failed.stats.fallback_reason,
        "equal": torch.equal(failed.sequences, whole.sequences),
        "later_path": later.stats.path,
        "later_equal": torch.equal(later.sequences, whole.sequences),
    }


def _refusals(rank: int, model) -> dict:
    """(e) no group -> error naming the field; a backend without collectives_in_graph -> eager."""
    ids, mask = prompts(2)
    try:
        make_engine(model).generate(ids, mask, SamplingParams(max_new_tokens=3))
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    eager = _engine(model, backend=NoCollectivesGraphBackend()).generate(
        ids, mask, SamplingParams(max_new_tokens=4, **NO_EOS)
    )
    return {"message": message, "path": eager.stats.path, "reason": eager.stats.fallback_reason}


def _collectives(rank: int, model) -> dict:
    """(f) the CPU graph alone: each collective it records replays as eagerly, on new values;
    the ones it cannot record are refused on every rank alike."""
    # private: the functional collectives DTensor issues are what the CPU graph must record
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    x = torch.zeros(4)
    outs = {name: torch.zeros(n) for name, n in (("ar", 4), ("ag", 8), ("rs", 2), ("bc", 4))}

    def step():
        reduced = x * 2
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        outs["ar"].copy_(reduced)
        outs["ag"].copy_(funcol.all_gather_tensor(x + 1, 0, group))
        outs["rs"].copy_(funcol.reduce_scatter_tensor(x, "sum", 0, group))
        outs["bc"].copy_(funcol.broadcast(x, 1, group))

    graph = CPUGraph()
    x.copy_(torch.arange(4.0) + 10 * rank)
    with torch.no_grad(), graph.capture():
        step()
    x.copy_(torch.arange(4.0) * (rank + 2))  # new values after capture
    step()
    eager = {name: out.clone() for name, out in outs.items()}
    for out in outs.values():
        out.zero_()
    graph.replay()
    refused = []
    for call in (
        lambda: dist.broadcast(x, 0),
        lambda: dist.all_reduce(x, async_op=True),
    ):
        try:
            with CPUGraph().capture():
                call()
            refused.append("captured")
        except GraphCaptureError as exc:
            refused.append(str(exc))
    return {
        "equal": {name: torch.equal(outs[name], eager[name]) for name in outs},
        "eager": eager,
        "refused": refused,
    }


SCENARIOS = {
    "collectives": _collectives,
    "sharded": _sharded,
    "same": _same,
    "early": _early,
    "recapture": _recapture,
    "failure": _failure,
    "refusals": _refusals,
}


def prepare(rank: int, out_dir: str) -> tuple[torch.nn.Module]:
    """The model every scenario runs: the saved tiny Llama, sharded over the two ranks."""
    return (_tp_model(os.path.join(out_dir, "model")),)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's records of every scenario (one spawn of two gloo processes)."""
    root = tmp_path_factory.mktemp("tp")
    tiny_model("llama").save_pretrained(root / "model")
    return spawn_ranks(__name__, root, DEADLINE_S, timeout_s=30)


def test_transformers_tp_plan_shards_the_projections(ranks):
    for rec in records(ranks, "sharded"):
        assert rec == {"type": "DTensor", "local": (32, 64), "full": (64, 64)}


@pytest.mark.parametrize("case", ["greedy", "sampled", "continuous"])
def test_graph_equals_eager_on_every_rank_and_across_ranks(ranks, case):
    first, second = (rec[case] for rec in records(ranks, "same"))
    graph_path = "continuous_graph" if case == "continuous" else "static_graph"
    for rec in (first, second):
        assert rec["path"] == graph_path and rec["replays"] > 0
        assert rec["equal"] and rec["whole_equal"]
    assert torch.equal(first["sequences"], second["sequences"])


def test_rank_finished_early_decodes_until_every_rank_is_done(ranks):
    first, second = records(ranks, "early")
    assert first["alone_steps"] == 4 and second["alone_steps"] == 19
    assert first["steps"] == second["steps"] == first["eager_steps"] == 19
    assert first["equal"] and second["equal"]
    assert first["path"] == second["path"] == "static_graph"


def test_one_rank_recapturing_late_makes_every_rank_recapture(ranks):
    first, second = records(ranks, "recapture")
    assert first["captures"] == second["captures"] == 2
    assert first["reason"] == ["another rank recaptures"] and second["reason"] == ["pad_id"]
    assert first["path"] == second["path"] == "static_graph"
    assert not first["third_captured"] and not second["third_captured"]
    assert first["equal"] and first["third_equal"]
    for rec in (first, second):  # the signature reads the local shard's address
        assert rec["new_shard_reason"] == ["tensors"] and rec["new_shard_equal"]


def test_capture_failing_mid_forward_on_one_rank_sends_every_rank_eager(ranks):
    first, second = records(ranks, "failure")
    assert first["path"] == second["path"] == "eager"
    assert "another rank" in first["reason"]
    assert "capture failed" in second["reason"] and "another rank" not in second["reason"]
    assert first["equal"] and second["equal"]
    assert first["later_path"] == second["later_path"] == "eager"
    assert first["later_equal"] and second["later_equal"]


def test_sharded_model_needs_a_group_and_a_backend_capturing_collectives(ranks):
    for rec in records(ranks, "refusals"):
        assert "process_group" in rec["message"] and "sharded over 2 ranks" in rec["message"]
        assert rec["path"] == "eager" and "collectives_in_graph=False" in rec["reason"]


def test_cpu_graph_replays_collectives_and_refuses_the_rest(ranks):
    first, second = records(ranks, "collectives")
    for rec in (first, second):
        assert all(rec["equal"].values()), rec["equal"]
        assert len(rec["refused"]) == 2 and all("torch.distributed" in r for r in rec["refused"])
    # the eager values the replay matched really are reductions over both ranks
    x0, x1 = torch.arange(4.0) * 2, torch.arange(4.0) * 3
    assert torch.equal(first["eager"]["ar"], torch.maximum(x0, x1) * 2)
    assert torch.equal(first["eager"]["ag"], torch.cat([x0 + 1, x1 + 1]))
    assert torch.equal(second["eager"]["rs"], (x0 + x1)[2:])
    assert torch.equal(first["eager"]["bc"], x1)
