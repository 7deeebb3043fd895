"""Sharded trainers: a round per training iteration served from the graphs of the first
(docs/trainers.md, "Sharded trainers").

Two gloo ranks on the CPU reference backend, each with its own prompts, run a trainer's loop
through the drop-in (``model.generate``): round, a real training step, round again.

* ZeRO-3's gather for generation, as TRL runs it with DeepSpeed (not installed here: the
  test plays its part): each rank holds a shard of every parameter (DeepSpeed's ``ds_id``,
  ``ds_status`` and ``ds_tensor``); before a round every parameter is all-gathered into new
  storage (``p.data = full``), after it released (``p.data = torch.empty(0)``); the training
  step gathers again, averages the gradients over the ranks and updates the shards in place.
* FSDP2 (``fully_shard`` on each decoder layer and the root): the round runs on the model as
  the trainer holds it (graphcap unshards it); the training step is FSDP2's own forward,
  backward (reduce-scatter) and an SGD step on the sharded parameters.

A twin of the model, never sharded, gets the same updates (its gradients averaged the same
way) and rolls out through a drop-in that never sleeps; tokens must be equal bit for bit, no
capture may follow the first round, and each round copies the weights once into what the
graphs read.
"""

from __future__ import annotations

import copy
import enum
import inspect

import pytest
import torch
import torch.distributed as dist
from rollout_models import prompts, tiny_model
from spawned_ranks import WORLD, records, spawn_ranks

from graphcap import Backend
from graphcap.cpu import CPUBackend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams, accelerate_generate

DEADLINE_S = 240
ROUNDS = 4
NEW = 5
ROWS = 3


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names for a ZeRO-3 parameter's state (``deepspeed.runtime.zero``)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def _round(model, ids, mask) -> torch.Tensor:
    """One rollout through ``model.generate``, sampled, one seed per call."""
    torch.manual_seed(3)
    return model.generate(
        ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW, top_k=0, eos_token_id=None
    )


def _loss(model, sequences: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=sequences).logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), sequences[:, 1:].reshape(-1)
    )


def _averaged_grads(model, sequences: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's gradient of the next-token loss, averaged over the ranks."""
    model.train()
    _loss(model, sequences).backward()
    model.eval()
    grads = []
    for p in model.parameters():
        dist.all_reduce(p.grad)
        grads.append(p.grad.div_(dist.get_world_size()))
        p.grad = None
    return grads


def _twin_step(twin, sequences: torch.Tensor) -> None:
    """The never-sharded twin's training step: SGD on the averaged gradients."""
    grads = _averaged_grads(twin, sequences)
    with torch.no_grad():
        for p, grad in zip(twin.parameters(), grads, strict=True):
            p.add_(grad, alpha=-0.5)


def _drop_ins(model, twin, backend: Backend):
    """The drop-in on ``model`` (sleeping after each call; returned) and on its twin (never
    sleeping)."""
    served = accelerate_generate(model, RolloutConfig(enable_graph_capture=True, backend=backend))
    reference = accelerate_generate(twin, RolloutConfig(enable_graph_capture=True, backend=backend))
    reference.sleep_between_calls = False
    return served


def _round_record(served, tokens, expected) -> dict:
    stats = served.stats.last
    return {
        "equal": torch.equal(tokens, expected),
        "tokens": tokens,
        "path": stats.path if stats is not None else None,
        "fallbacks": dict(served.stats.fallbacks),
        "captures": stats.captures if stats is not None else None,
        "weights": stats.weights if stats is not None else None,
        "copied": stats.weights_copied if stats is not None else None,
        "asleep": served.engine.sleeping,
        "still_held": served.engine.last_sleep.still_held_bytes
        if served.engine.last_sleep
        else None,
    }


# ---- ZeRO-3's gather for generation -------------------------------------------------------------
def _partition(model, rank: int) -> None:
    """Keep this rank's shard of every parameter, as ZeRO-3 does; the full tensors go."""
    for i, p in enumerate(model.parameters()):
        flat = p.data.flatten()
        p.ds_id, p.ds_shape, p.ds_numel = i, p.shape, flat.numel()
        p.ds_tensor = flat.chunk(dist.get_world_size())[rank].clone()
        _release(p)


def _release(p) -> None:
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _gather(model) -> None:
    """Every parameter all-gathered into new storage (ZeRO-3's ``GatheredParameters``)."""
    for p in model.parameters():
        parts = [torch.empty_like(p.ds_tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, p.ds_tensor)
        p.data = torch.cat(parts)[: p.ds_numel].view(p.ds_shape)
        p.ds_status = ZeroParamStatus.AVAILABLE


def _on(backend: Backend | None, rank: int):
    """The backend (CPU by default), a fresh tiny llama and this rank's prompts on its device."""
    backend = backend or CPUBackend()
    model = tiny_model("llama", fresh=True).to(backend.device)
    ids, mask = (t.to(backend.device) for t in prompts(ROWS, seed=rank))
    return backend, model, ids, mask


def zero3(rank: int, backend: Backend | None = None) -> dict:
    """The ZeRO-3 scenario on ``backend`` (CPU by default), at the process group's size."""
    backend, model, ids, mask = _on(backend, rank)
    twin = copy.deepcopy(model)
    _partition(model, rank)
    served = _drop_ins(model, twin, backend)
    weight_bytes = sum(p.ds_numel * p.element_size() for p in model.parameters())
    rounds, held = [], []
    for _ in range(ROUNDS):
        _gather(model)
        tokens = _round(model, ids, mask)
        held.append(served.engine.memory_held())
        for p in model.parameters():
            _release(p)
        rounds.append(_round_record(served, tokens, _round(twin, ids, mask)))
        # the training step: gather, gradients averaged over the ranks, shards updated in place
        _gather(model)
        grads = _averaged_grads(model, tokens)
        with torch.no_grad():
            for p, grad in zip(model.parameters(), grads, strict=True):
                _release(p)
                p.ds_tensor.add_(grad.flatten().chunk(dist.get_world_size())[rank], alpha=-0.5)
        _twin_step(twin, tokens)
    return {
        "rounds": rounds,
        "tensors": len(list(model.parameters())) + len(list(model.buffers())),
        "held": held,
        "weight_bytes": weight_bytes,
    }


# ---- FSDP2 -------------------------------------------------------------------------------------
def fsdp2(rank: int, backend: Backend | None = None) -> dict:
    """The FSDP2 scenario on ``backend`` (CPU by default), at the process group's size."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    backend, model, ids, mask = _on(backend, rank)
    twin = copy.deepcopy(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    served = _drop_ins(model, twin, backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    gathers = {"count": 0}
    # the collective FSDP2's all-gathers call: all_gather_single in torch 2.13,
    # all_gather_into_tensor before (torch 2.11 on the GPU machine)
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    all_gather = getattr(dist, name)

    def counted(*args, **kwargs):
        gathers["count"] += 1
        return all_gather(*args, **kwargs)

    rounds, gathered, sharded_after = [], [], []
    setattr(dist, name, counted)
    try:
        for _ in range(ROUNDS):
            gathers["count"] = 0
            tokens = _round(model, ids, mask)
            gathered.append(gathers["count"])
            sharded_after.append(all(isinstance(p, DTensor) for p in model.parameters()))
            rounds.append(_round_record(served, tokens, _round(twin, ids, mask)))
            # FSDP2's own training step: forward, backward (gradients reduce-scattered and
            # averaged), SGD on the shards
            model.train()
            _loss(model, tokens).backward()
            model.eval()
            optimizer.step()
            optimizer.zero_grad()
            _twin_step(twin, tokens)
        # generate's own per-layer gathers, for comparison
        served.restore()
        gathers["count"] = 0
        _round(model, ids, mask)
        plain = gathers["count"]
    finally:
        setattr(dist, name, all_gather)
    # FSDP reallocates its unsharded storage in place: served from a copy whatever the mode
    config = RolloutConfig(enable_graph_capture=True, backend=backend, weights="model")
    asked_model = RolloutEngine(model, config).generate(ids, mask, SamplingParams(max_new_tokens=3))
    return {
        "rounds": rounds,
        "gathered": gathered,
        "plain_gathers": plain,
        "asked_model": (asked_model.stats.path, asked_model.stats.weights),
        "sharded_after": sharded_after,
        "tensors": len(list(model.parameters())) + len(list(model.buffers())),
    }


SCENARIOS = {"zero3": zero3, "fsdp2": fsdp2}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's records of both scenarios (one spawn of two gloo processes)."""
    return spawn_ranks(__name__, tmp_path_factory.mktemp("ranks"), DEADLINE_S, timeout_s=60)


def check_served_from_the_first_rounds_graphs(rec: dict) -> None:
    """Every round replayed the first round's graphs on one weight copy, tokens equal to the
    never-sharded twin's, nothing held while the trainer trained."""
    first = rec["rounds"][0]
    for i, rnd in enumerate(rec["rounds"]):
        assert rnd["path"] == "static_graph", (i, rnd["fallbacks"])
        assert rnd["equal"], f"round {i}: tokens differ from the never-sharded twin's"
        assert rnd["captures"] == first["captures"], f"round {i} captured again"
        # one copy a tensor per round, into the engine's copy; released while the trainer trains
        assert rnd["weights"] == "copy" and rnd["copied"] == rec["tensors"], (i, rnd)
        assert rnd["asleep"] and rnd["still_held"] == 0, (i, rnd)
    # the training steps' updates reach the rounds: their tokens move
    tokens = [rnd["tokens"] for rnd in rec["rounds"]]
    assert any(not torch.equal(tokens[0], later) for later in tokens[1:])


@pytest.mark.parametrize("rank", range(WORLD))
def test_zero3_gathered_rounds_replay_the_first_rounds_graphs(ranks, rank):
    rec = records(ranks, "zero3")[rank]
    check_served_from_the_first_rounds_graphs(rec)
    # the engine's copy lives in its memory region (given back at each sleep)
    assert all(held >= rec["weight_bytes"] for held in rec["held"]), rec["held"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_fsdp2_rounds_replay_the_first_rounds_graphs_with_one_unshard_a_round(ranks, rank):
    rec = records(ranks, "fsdp2")[rank]
    check_served_from_the_first_rounds_graphs(rec)
    # one all-gather per FSDP module (2 layers and the root) a round, whatever its length;
    # generate gathers every layer for every token
    assert rec["gathered"] == [3] * ROUNDS, rec["gathered"]
    assert rec["plain_gathers"] >= 2 * NEW
    # the trainer gets its shards back after each round
    assert all(rec["sharded_after"])
    assert rec["asked_model"] == ("static_graph", "copy")


def test_the_private_fsdp_names_graphcap_reads_are_still_there():
    """graphcap/rollout/holder/fsdp.py holds FSDP's hooks idle through three private names of
    torch; a torch that renames one, or whose hooks stop skipping in that state, fails here."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_state
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    assert callable(getattr(FSDPModule, "_get_fsdp_state", None)), "_get_fsdp_state is gone"
    assert "self._training_state" in inspect.getsource(_fsdp_state.FSDPState.__init__)
    for hook in (_fsdp_state.FSDPState._pre_forward, _fsdp_state.FSDPState._post_forward):
        source = inspect.getsource(hook)
        assert "if self._training_state == TrainingState.PRE_BACKWARD:" in source, (
            f"{hook.__qualname__} no longer returns early in TrainingState.PRE_BACKWARD"
        )
    assert TrainingState.PRE_BACKWARD.name == "PRE_BACKWARD"
