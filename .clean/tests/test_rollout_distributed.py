"""Tensor-parallel agreement: two gloo ranks on CPU run rollouts with ``process_group`` set.

The tiny model has no collectives, so a missing agreement does not hang here: it shows as ranks
that took different decisions (step counts, captures, paths), or as the agreement's own
collectives no longer pairing up (gloo then raises in the scenario). All scenarios run in one
spawn of two processes (start-up dominates); each test checks one scenario's records.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from rollout_models import prompts, run, tiny_model
from spawned_ranks import records, spawn_ranks

from graphcap.cpu import CPUBackend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams

DEADLINE_S = 120
NO_EOS = {"eos_token_id": []}


def _engine(model, **config) -> RolloutEngine:
    return RolloutEngine(
        model,
        RolloutConfig(
            enable_graph_capture=True,
            backend=CPUBackend(),
            process_group=dist.group.WORLD,
            **config,
        ),
    )


def _same(rank: int) -> dict:
    """(a) same model and prompts on both ranks, graphs on: eager's tokens, graphs used."""
    model = tiny_model("llama")
    ids, mask = prompts(3)
    params = {"do_sample": True, "top_k": 10, "max_new_tokens": 8, "seed": 3, **NO_EOS}
    graph = _engine(model).generate(ids, mask, SamplingParams(**params))
    eager = run(model, ids, mask, False, **params)
    cont = _engine(model, continuous_batch_size=2).generate(
        ids, mask, SamplingParams(max_new_tokens=8, **NO_EOS)
    )
    cont_eager = run(model, ids, mask, False, max_new_tokens=8, **NO_EOS)
    return {
        "path": graph.stats.path,
        "equal": torch.equal(graph.sequences, eager.sequences),
        "cont_path": cont.stats.path,
        "cont_equal": torch.equal(cont.sequences, cont_eager.sequences),
    }


def _early(rank: int) -> dict:
    """(b) rank 0's rows all end at their third token, rank 1's never end."""
    model = tiny_model("llama")
    ids, mask = prompts(3)
    new, width = 20, ids.shape[1]
    probe = run(model, ids, mask, False, max_new_tokens=new, **NO_EOS)
    eos = sorted({int(t) for t in probe.sequences[:, width + 2]}) if rank == 0 else []
    params = SamplingParams(max_new_tokens=new, eos_token_id=eos)
    static = _engine(model, eos_check_interval=4).generate(ids, mask, params)
    alone = RolloutEngine(
        model, RolloutConfig(enable_graph_capture=True, backend=CPUBackend(), eos_check_interval=4)
    ).generate(ids, mask, params)
    cont_params = SamplingParams(max_new_tokens=12, eos_token_id=eos)
    cont = _engine(model, eos_check_interval=4, continuous_batch_size=2).generate(
        ids, mask, cont_params
    )
    cont_alone = RolloutEngine(
        model,
        RolloutConfig(
            enable_graph_capture=True,
            backend=CPUBackend(),
            eos_check_interval=4,
            continuous_batch_size=2,
        ),
    ).generate(ids, mask, cont_params)
    return {
        "steps": static.stats.steps,
        "alone_steps": alone.stats.steps,
        "equal": torch.equal(static.sequences, alone.sequences),
        "path": static.stats.path,
        "cont_steps": cont.stats.steps,
        "cont_alone_steps": cont_alone.stats.steps,
        "cont_equal": torch.equal(cont.sequences, cont_alone.sequences),
        "cont_path": cont.stats.path,
    }


def _recapture(rank: int) -> dict:
    """(c) the second call changes a signature member (the pad id) on rank 1 only."""
    model = tiny_model("llama")
    ids, mask = prompts(3)
    out = {}
    for name, config, new in (
        ("static", {}, 8),
        ("per_position", {"per_position_graphs": True}, 4),
        ("continuous", {"continuous_batch_size": 2}, 8),
    ):
        engine = _engine(model, **config)
        same = SamplingParams(max_new_tokens=new, min_new_tokens=new, **NO_EOS)
        changed = SamplingParams(max_new_tokens=new, min_new_tokens=new, pad_token_id=3, **NO_EOS)
        first = engine.generate(ids, mask, same)
        second = engine.generate(ids, mask, changed if rank == 1 else same)
        out[name] = {
            "captures": second.stats.captures,
            "captured": second.stats.captured,
            "reason": second.stats.recapture_reason,
            "path": second.stats.path,
            "equal": torch.equal(first.sequences, second.sequences),
        }
    return out


def _failure(rank: int) -> dict:
    """(d) every capture on rank 1 does a host read mid-capture, which the CPU graph refuses."""
    model = tiny_model("llama", fresh=True)
    backends = [CPUBackend(), CPUBackend()]

    def host_read_during_capture(module, args, output):
        if rank == 1 and any(b.is_current_stream_capturing() for b in backends):
            output[0].sum().item()

    model.model.layers[1].register_forward_hook(host_read_during_capture)
    ids, mask = prompts(3)
    out = {}
    for backend, (name, config) in zip(
        backends, (("static", {}), ("per_position", {"per_position_graphs": True})), strict=True
    ):
        engine = RolloutEngine(
            model,
            RolloutConfig(
                enable_graph_capture=True,
                backend=backend,
                process_group=dist.group.WORLD,
                **config,
            ),
        )
        params = {"do_sample": True, "top_k": 10, "max_new_tokens": 6, "min_new_tokens": 6}
        params |= {"seed": 4, **NO_EOS}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            failed = engine.generate(ids, mask, SamplingParams(**params))
            later = engine.generate(ids, mask, SamplingParams(**params))
        pure = run(model, ids, mask, False, **params)
        out[name] = {
            "path": failed.stats.path,
            "reason": failed.stats.fallback_reason,
            "equal": torch.equal(failed.sequences, pure.sequences),
            "later_path": later.stats.path,
            "later_reason": later.stats.fallback_reason,
            "later_equal": torch.equal(later.sequences, pure.sequences),
        }
    return out


def _validation(rank: int) -> dict:
    try:
        RolloutConfig(process_group="world")
    except TypeError as exc:
        return {"message": str(exc)}
    return {"message": "no error"}


SCENARIOS = {
    "same": _same,
    "early": _early,
    "recapture": _recapture,
    "failure": _failure,
    "validation": _validation,
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's records of every scenario (one spawn of two gloo processes)."""
    return spawn_ranks(__name__, tmp_path_factory.mktemp("ranks"), DEADLINE_S, timeout_s=20)


def test_same_inputs_give_eager_tokens_with_graphs(ranks):
    for rec in records(ranks, "same"):
        assert rec["path"] == "static_graph" and rec["equal"]
        assert rec["cont_path"] == "continuous_graph" and rec["cont_equal"]


def test_rank_finished_early_decodes_until_every_rank_is_done(ranks):
    first, second = records(ranks, "early")
    # alone, rank 0 would stop at the first check; with the group it waits for rank 1
    assert first["alone_steps"] == 4 and second["alone_steps"] == 19
    assert first["steps"] == second["steps"] == 19
    assert first["equal"] and second["equal"]
    assert first["path"] == second["path"] == "static_graph"
    # continuous: rows retire on the same step on both ranks, so the loops are equally long
    assert first["cont_alone_steps"] < second["cont_alone_steps"]
    assert first["cont_steps"] == second["cont_steps"] == second["cont_alone_steps"]
    assert first["cont_equal"] and second["cont_equal"]
    assert first["cont_path"] == second["cont_path"] == "continuous_graph"


@pytest.mark.parametrize("path", ["static", "per_position", "continuous"])
def test_one_rank_recapturing_makes_every_rank_recapture(ranks, path):
    first, second = (rec[path] for rec in records(ranks, "recapture"))
    per_call = 3 if path == "per_position" else 1  # per-position: one graph per decode step
    assert first["captures"] == second["captures"] == 2 * per_call
    assert first["captured"] and second["captured"]
    assert first["reason"] == ["another rank recaptures"]
    assert second["reason"] == ["pad_id"]
    assert first["path"] == second["path"] == f"{path}_graph"
    assert first["equal"]  # the fresh graph replays the same tokens


@pytest.mark.parametrize("path", ["static", "per_position"])
def test_capture_failure_on_one_rank_sends_every_rank_eager(ranks, path):
    first, second = (rec[path] for rec in records(ranks, "failure"))
    assert first["path"] == second["path"] == "eager"
    assert "another rank" in first["reason"]
    assert "capture failed" in second["reason"] and "another rank" not in second["reason"]
    assert first["equal"] and second["equal"]
    # graphs stay off on both ranks afterwards
    assert first["later_path"] == second["later_path"] == "eager"
    assert "another rank" in first["later_reason"] and "capture failed" in second["later_reason"]
    assert first["later_equal"] and second["later_equal"]


def test_process_group_is_validated(ranks):
    for rec in (r["validation"] for r in ranks):
        assert "must be a torch.distributed.ProcessGroup" in rec["message"]
    with pytest.raises(ValueError, match="not initialised"):
        RolloutConfig(process_group=object())
