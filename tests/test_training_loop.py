"""A training run captures once: sleep, training steps and weights in new storage replay the
graphs already captured (docs/trainers.md, "A training run").

Each test runs a trainer's loop on the CPU reference backend, whose memory region releases
pages at a sleep, refuses replays on released storage and poisons what it maps again: round,
sleep, a real training step (forward, backward, SGD step) on the round's rows, round again,
then rounds after every parameter's storage moved (same values, then new ones). A twin model
receives the same updates in place and rolls out on an engine that never sleeps and never sees
a move; the tokens must be equal, bit for bit in fp32, and no capture may follow the first
iteration's.
"""

from __future__ import annotations

import copy
import dataclasses
import mmap
import sys
import warnings

import pytest
import torch
from rollout_models import prompts, tiny_model

from graphcap.cpu import CPUBackend
from graphcap.rollout import (
    HeldMemoryWarning,
    RolloutConfig,
    RolloutEngine,
    SamplingParams,
    accelerate_generate,
)

NEW = 5
ROWS = 3
#: per-row seeds: a row's draws depend on nothing but its seed
SAMPLED = [SamplingParams(max_new_tokens=NEW, do_sample=True, seed=11 + i) for i in range(ROWS)]
PATHS = {
    "static-blocks": {},
    "static-cache": {"kv_block_size": None},
    "continuous-blocks": {"continuous_batch_size": 2},
    "continuous-cache": {"continuous_batch_size": 2, "kv_block_size": None},
}


def train_step(model: torch.nn.Module, sequences: torch.Tensor) -> None:
    """One SGD step of next-token loss on the round's rows (updates in place)."""
    model.train()
    logits = model(input_ids=sequences).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), sequences[:, 1:].reshape(-1)
    )
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.5)
            p.grad = None
    model.eval()


def move_storage(model: torch.nn.Module, new_values: bool) -> None:
    """Every parameter and buffer in new storage (as a ZeRO-3 gather or
    ``load_state_dict(assign=True)`` leaves them); the old storage is dropped by the model."""
    with torch.no_grad():
        for module in model.modules():
            for p in module.parameters(recurse=False):
                p.data = p.data.clone() + (0.01 if new_values else 0.0)
            for name, b in list(module.named_buffers(recurse=False)):
                module._buffers[name] = b.clone()


def same_values(twin: torch.nn.Module, model: torch.nn.Module) -> None:
    """``twin``'s parameters and buffers take ``model``'s values, in place (a device's backward
    is not bitwise reproducible between two models: its atomics add in any order)."""
    with torch.no_grad():
        for mine, theirs in zip(
            twin.state_dict().values(), model.state_dict().values(), strict=True
        ):
            mine.copy_(theirs)


def nudge_in_place(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)


class Roller:
    """One way of rolling out: the engine, or the drop-in under ``model.generate``."""

    def __init__(self, model, config: RolloutConfig, drop_in: bool):
        self.model, self.drop_in = model, drop_in
        if drop_in:
            self.installed = accelerate_generate(model, config)
            self.engine = self.installed.engine
        else:
            self.engine = RolloutEngine(model, config)

    def round(self, ids, mask) -> tuple[torch.Tensor, object]:
        if self.drop_in:
            generation = dict(do_sample=True, max_new_tokens=NEW, top_k=0, eos_token_id=None)
            # generate's settings do not carry per-row seeds: one seed per call through the
            # engine's keyed draws, from a generator seeded the same on both sides
            torch.manual_seed(3)
            out = self.model.generate(ids, attention_mask=mask, **generation)
            return out, self.installed.stats.last
        result = self.engine.generate(ids, mask, SAMPLED)
        return result.sequences, result.stats

    def sleep(self) -> None:
        if not self.drop_in:  # the drop-in sleeps by itself after every call
            self.engine.sleep()


@pytest.mark.parametrize("drop_in", [False, True], ids=["engine", "drop_in"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_training_loop_captures_once(path, drop_in):
    model = tiny_model("llama", fresh=True)
    twin = copy.deepcopy(model)
    config = RolloutConfig(enable_graph_capture=True, backend=CPUBackend(), **PATHS[path])
    roller = Roller(model, config, drop_in)
    reference = Roller(twin, dataclasses.replace(config, backend=CPUBackend()), drop_in)
    if drop_in:
        reference.installed.sleep_between_calls = False  # the reference never sleeps
    ids, mask = prompts(ROWS)
    captures = None
    events = ["sleep+train"] * 5 + ["move", "move+new", "move", "in-place"]
    for i, event in enumerate(events):
        tokens, stats = roller.round(ids, mask)
        expected, _ = reference.round(ids, mask)
        assert torch.equal(tokens, expected), f"iteration {i} ({events[i - 1] if i else 'first'})"
        assert stats.path.endswith("graph"), stats.fallback_reason
        if captures is None:
            captures = stats.captures
        assert stats.captures == captures, f"iteration {i}: {stats.recapture_reason}"
        if event == "sleep+train":
            roller.sleep()
            assert roller.engine.sleeping
            train_step(model, tokens)
            train_step(twin, expected)
        elif event.startswith("move"):
            new = event.endswith("new")
            move_storage(model, new_values=new)
            if new:
                nudge_in_place(twin)
        else:
            nudge_in_place(model)
            nudge_in_place(twin)
    tokens, stats = roller.round(ids, mask)
    assert torch.equal(tokens, reference.round(ids, mask)[0])
    # the model lives in its new storage since the moves: the graphs read what they captured
    assert stats.captures == captures and stats.weights == "adopted"


def test_moved_weights_are_copied_into_what_the_graphs_read_and_the_old_storage_is_kept():
    model = tiny_model("llama", fresh=True)
    engine = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=CPUBackend()))
    ids, mask = prompts(ROWS)
    first = engine.generate(ids, mask, SAMPLED)
    assert first.stats.weights == "model" and first.stats.weights_copied == 0
    captured = {n: p.data_ptr() for n, p in model.named_parameters()}
    move_storage(model, new_values=False)
    moved = {n: p.data_ptr() for n, p in model.named_parameters()}
    again = engine.generate(ids, mask, SAMPLED)
    assert again.stats.weights == "adopted" and not again.stats.captured
    assert again.stats.weights_copied == len(list(model.parameters())) + len(list(model.buffers()))
    assert torch.equal(again.sequences, first.sequences)
    # the model keeps its new storage after the call; the graphs kept theirs
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == moved
    assert all(captured[n] != moved[n] for n in captured)


def test_a_sleep_that_keeps_moved_weights_storage_says_so_once_and_how_to_avoid_it():
    model = tiny_model("llama", fresh=True)
    engine = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=CPUBackend()))
    ids, mask = prompts(ROWS)
    engine.generate(ids, mask, SAMPLED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HeldMemoryWarning)
        engine.sleep()  # nothing moved: nothing kept, nothing said
    move_storage(model, new_values=False)
    engine.generate(ids, mask, SAMPLED)
    with pytest.warns(HeldMemoryWarning, match=r"weights='copy'") as said:
        engine.sleep()
    assert said[0].filename == __file__  # points at the caller's sleep()
    assert engine.last_sleep.still_held_bytes > 0
    engine.generate(ids, mask, SAMPLED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HeldMemoryWarning)
        engine.sleep()  # once per engine
    assert engine.last_sleep.still_held_bytes > 0


def test_copy_mode_serves_from_its_own_copy_released_at_sleep():
    model = tiny_model("llama", fresh=True)
    config = RolloutConfig(enable_graph_capture=True, backend=CPUBackend(), weights="copy")
    engine = RolloutEngine(model, config)
    ids, mask = prompts(ROWS)
    first = engine.generate(ids, mask, SAMPLED)
    assert first.stats.weights == "copy" and first.stats.weights_copied > 0
    weight_bytes = sum(p.nbytes for p in model.parameters())
    assert engine.memory_held() >= weight_bytes  # the copy lives in the engine's region
    engine.sleep()
    move_storage(model, new_values=True)
    twin = copy.deepcopy(model)
    again = engine.generate(ids, mask, SAMPLED)
    assert not again.stats.captured and again.stats.wake_s is not None
    reference = RolloutEngine(twin, dataclasses.replace(config, backend=CPUBackend()))
    assert torch.equal(again.sequences, reference.generate(ids, mask, SAMPLED).sequences)


@pytest.mark.parametrize("weights", ["model", "copy"])
def test_a_parameter_replaced_by_new_values_is_read_from_what_the_graph_captured(weights):
    """A parameter object replaced with new values (as ``load_state_dict(assign=True)`` does):
    the graph reads the memory its capture saw (the engine's copy, or the adopted storage),
    refilled from the new object; a replay that followed tensor objects (the embedding reads
    its weight object directly) would read the old one."""
    model = tiny_model("llama", fresh=True)
    config = RolloutConfig(enable_graph_capture=True, backend=CPUBackend(), weights=weights)
    engine = RolloutEngine(model, config)
    ids, mask = prompts(ROWS)
    first = engine.generate(ids, mask, SAMPLED)
    embed = model.model.embed_tokens
    embed.weight = torch.nn.Parameter(embed.weight.detach() * 1.5)  # a new object, new values
    twin = copy.deepcopy(model)
    again = engine.generate(ids, mask, SAMPLED)
    reference = RolloutEngine(twin, dataclasses.replace(config, backend=CPUBackend()))
    assert not again.stats.captured
    assert torch.equal(again.sequences, reference.generate(ids, mask, SAMPLED).sequences)
    assert not torch.equal(again.sequences, first.sequences)


def test_a_replay_never_reads_released_memory():
    """The reference region refuses a replay on released storage, so a graph replayed during
    a sleep fails instead of reading memory the device no longer has."""
    model = tiny_model("llama", fresh=True)
    engine = RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=CPUBackend()))
    ids, mask = prompts(ROWS)
    engine.generate(ids, mask, SAMPLED)
    graph = engine._holder.graph()  # the held graph, replayed by hand
    engine.sleep()
    with pytest.raises(Exception, match="released"):
        engine.backend.replay_graph(graph)
    engine.wake_up()
    engine.backend.replay_graph(graph)


def resident_bytes() -> int:
    """This process's resident memory (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_sleep_gives_the_memory_back_to_the_host():
    """The region's pages go back to the host kernel at a sleep: this process's resident
    memory falls by most of what the engine held (the host copies of kept buffers stay; on a
    device they are host memory, not device memory) and rises again when the engine wakes.
    The host's own free-memory report moves with every other process here, so this reads
    the process's own pages."""
    model = tiny_model("llama", fresh=True, max_position_embeddings=8192)
    config = RolloutConfig(
        enable_graph_capture=True,
        backend=CPUBackend(),
        kv_block_size=None,
        length_buckets=(8192,),  # large buffers for a short call
    )
    engine = RolloutEngine(model, config)
    ids, mask = prompts(16)
    engine.generate(ids, mask, SamplingParams(max_new_tokens=3, eos_token_id=[]))
    held = engine.memory_held()
    assert held > 64 << 20
    before = resident_bytes()
    engine.sleep()
    asleep = resident_bytes()
    report = engine.last_sleep
    assert report.kept_graphs and report.held_bytes == held and report.still_held_bytes == 0
    assert before - asleep > 0.5 * held
    engine.wake_up()
    assert not engine.sleeping and resident_bytes() - asleep > 0.5 * held


def held_tensors(value: object, path: str = "step", depth: int = 4) -> dict[str, torch.Tensor]:
    """Every tensor reachable from ``value``'s attributes (``depth`` levels), by path."""
    if isinstance(value, torch.Tensor):
        return {path: value}
    if depth == 0 or isinstance(value, (torch.nn.Module, str, bytes, int, float)):
        return {}
    if isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    elif hasattr(value, "__dict__"):
        items = vars(value).items()
    else:
        return {}
    found = {}
    for key, item in items:
        found.update(held_tensors(item, f"{path}.{key}", depth - 1))
    return found


@pytest.mark.parametrize("layout", [{}, {"kv_block_size": None}], ids=["blocks", "static-cache"])
def test_a_sleep_keeps_every_buffer_but_the_kv_pools(layout):
    """What the graphs read besides the K/V pools (positions, tables, index tensors of the
    cache's writes, masks, row settings) comes back from a sleep as it was: a compiled step
    reads the cache's index tensors, which an uncompiled one does not."""
    model = tiny_model("llama", fresh=True)
    config = RolloutConfig(enable_graph_capture=True, backend=CPUBackend(), **layout)
    engine = RolloutEngine(model, config)
    ids, mask = prompts(ROWS)
    engine.generate(ids, mask, SAMPLED)
    pools = {id(t) for layer in engine.cache.layers for t in (layer.keys, layer.values)}
    before = {
        path: t.clone() for path, t in held_tensors(engine.step).items() if id(t) not in pools
    }
    assert any(path.endswith(".rows") or path.endswith(".table") for path in before)
    engine.sleep()
    engine.wake_up()
    after = held_tensors(engine.step)
    changed = [path for path, t in before.items() if not torch.equal(after[path], t)]
    assert not changed, f"lost at a sleep: {changed}"
