"""``RolloutEngine.sleep()`` on a backend that cannot keep addresses across a release: the
buffers and graphs go, the weights stay, the next call recaptures (tests/test_training_loop.py
covers backends that keep them).

The CPU has no allocator statistics, so these tests check that the freed objects are gone
(weak references to the cache, mask and state tensors, the step and the graphs) and that the
backend was asked to return memory; tests/test_device_rollout.py measures the bytes on a device.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from rollout_models import prompts, tiny_model

from graphcap.cpu import CPUBackend
from graphcap.errors import WakeMemoryError
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.engine import WOKE

NEW = 6
PARAMS = SamplingParams(max_new_tokens=NEW, eos_token_id=[])
PINNED = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=[])


class FreeingBackend(CPUBackend):
    """The CPU reference backend without memory regions: a sleep frees."""

    def memory_region(self) -> None:
        return None


class RecordingBackend(FreeingBackend):
    """Keeps weak references to its graphs and counts ``empty_cache`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.graphs: list[weakref.ref] = []
        self.emptied = 0

    def create_graph(self) -> object:
        graph = super().create_graph()
        self.graphs.append(weakref.ref(graph))
        return graph

    def empty_cache(self) -> None:
        self.emptied += 1
        super().empty_cache()


def engine_on(backend: CPUBackend, **config: object) -> RolloutEngine:
    model = tiny_model("llama", fresh=True)
    return RolloutEngine(model, RolloutConfig(enable_graph_capture=True, backend=backend, **config))


def held_objects(engine: RolloutEngine) -> list[weakref.ref]:
    """Weak references to the step, its K/V, mask and state tensors."""
    step = engine.step
    tensors = [t for layer in engine.cache.layers for t in (layer.keys, layer.values)]
    tensors += step.mutable_tensors()
    return [weakref.ref(step), weakref.ref(step.cache), *(weakref.ref(t) for t in tensors)]


@pytest.mark.parametrize(
    ("config", "params", "path"),
    [
        ({}, PARAMS, "static_graph"),
        ({"per_position_graphs": True}, PINNED, "per_position_graph"),
        ({"continuous_batch_size": 2}, PARAMS, "continuous_graph"),
    ],
    ids=["static", "per_position", "continuous"],
)
def test_sleep_frees_buffers_and_graphs_and_the_next_call_recaptures(config, params, path):
    backend = RecordingBackend()
    assert not backend.capabilities.keeps_addresses_on_release
    engine = engine_on(backend, **config)
    weights = {n: (p.data_ptr(), p.detach().clone()) for n, p in engine.model.named_parameters()}
    ids, mask = prompts(3)
    first = engine.generate(ids, mask, params)
    assert first.stats.path == path and first.stats.captured
    captures = first.stats.captures
    held = held_objects(engine)
    emptied = backend.emptied

    engine.sleep()
    gc.collect()
    assert engine.cache is None and engine.step is None
    alive = [type(ref()).__name__ for ref in held + backend.graphs if ref() is not None]
    assert not alive, f"still alive after sleep: {alive}"
    assert backend.emptied > emptied  # the memory freed goes back to the device
    for name, p in engine.model.named_parameters():  # the weights are untouched
        assert p.data_ptr() == weights[name][0] and torch.equal(p, weights[name][1]), name

    again = engine.generate(ids, mask, params)
    assert torch.equal(again.sequences, first.sequences)
    stats = again.stats
    assert stats.path == path and stats.captured and stats.recapture_reason == [WOKE]
    assert stats.captures == 2 * captures and stats.capture_s > 0
    assert stats.first_call_s == stats.total_s

    third = engine.generate(ids, mask, params)  # awake again: replays only
    assert not third.stats.captured and third.stats.recapture_reason == []
    assert third.stats.captures == 2 * captures
    engine.shutdown()


def test_wake_up_and_sleep_are_safe_in_any_order():
    engine = engine_on(FreeingBackend())
    ids, mask = prompts(2)
    engine.wake_up()
    engine.sleep()  # nothing held yet: the first capture is not a wake-up
    first = engine.generate(ids, mask, PARAMS)
    assert first.stats.captured and first.stats.recapture_reason == []
    engine.sleep()
    engine.sleep()
    engine.wake_up()  # allocates nothing: generate reacquires
    assert engine.cache is None
    again = engine.generate(ids, mask, PARAMS)
    assert again.stats.recapture_reason == [WOKE] and again.stats.captures == 2
    assert torch.equal(again.sequences, first.sequences)
    engine.shutdown()
    for call in (engine.sleep, engine.wake_up):
        with pytest.raises(RuntimeError, match="shut down"):
            call()


def test_sleep_waits_for_a_running_generate():
    """A sleep from another thread must not free the buffers under a running call."""
    engine = engine_on(FreeingBackend())
    ids, mask = prompts(3)
    expected = engine.generate(ids, mask, PARAMS).sequences
    sleeper = threading.Thread(target=engine.sleep)
    blocked: list[bool] = []

    def start_sleeper(module, args):
        if not sleeper.is_alive() and not blocked:
            sleeper.start()
            sleeper.join(timeout=0.3)
            blocked.append(sleeper.is_alive())

    handle = engine.model.lm_head.register_forward_pre_hook(start_sleeper)
    result = engine.generate(ids, mask, PARAMS)  # the hook fires in the prefill
    handle.remove()
    sleeper.join()
    assert blocked == [True], "sleep ran while generate held the engine"
    assert torch.equal(result.sequences, expected)
    assert engine.cache is None
    engine.shutdown()


def test_sampled_tokens_do_not_depend_on_sleeping():
    """Unseeded samples draw from the global generator; a sleep (and the recapture it causes)
    leaves the draws as they would have been."""
    sampled = SamplingParams(max_new_tokens=NEW, do_sample=True, top_k=20, eos_token_id=[])
    ids, mask = prompts(3)
    outputs = {}
    for sleeps in (False, True):
        engine = engine_on(FreeingBackend())
        torch.manual_seed(5)
        calls = []
        for _ in range(3):
            calls.append(engine.generate(ids, mask, sampled))
            if sleeps:
                engine.sleep()
        outputs[sleeps] = [c.sequences for c in calls]
        assert calls[-1].stats.captures == (3 if sleeps else 1)
        engine.shutdown()
    assert not torch.equal(outputs[False][0], outputs[False][1])  # the draws moved on
    for slept, kept in zip(outputs[True], outputs[False], strict=True):
        assert torch.equal(slept, kept)


def test_sleep_keeps_graphs_false_frees_on_a_backend_with_regions():
    """``RolloutConfig(sleep_keeps_graphs=False)`` turns memory regions off: the CPU reference
    backend hands them out, and still the sleep frees and the next call captures again."""
    backend = CPUBackend()
    assert backend.capabilities.keeps_addresses_on_release
    engine = engine_on(backend, sleep_keeps_graphs=False)
    ids, mask = prompts(2)
    first = engine.generate(ids, mask, PARAMS)
    assert engine.memory_held() == 0  # nothing lives in a region
    engine.sleep()
    assert engine.cache is None and not engine.sleeping
    assert not engine.last_sleep.kept_graphs
    again = engine.generate(ids, mask, PARAMS)
    assert again.stats.recapture_reason == [WOKE] and torch.equal(again.sequences, first.sequences)
    engine.shutdown()


class ShortBackend(CPUBackend):
    """The CPU reference backend reporting ``free`` bytes free while ``free`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.free: int | None = None
        self.emptied = 0

    def free_memory(self) -> int | None:
        return self.free if self.free is not None else super().free_memory()

    def empty_cache(self) -> None:
        self.emptied += 1
        super().empty_cache()


@pytest.mark.parametrize("wake", ["wake_up", "next_call"])
def test_a_wake_without_the_memory_to_map_refuses_and_stays_asleep(wake):
    """A trainer still holding what the sleep gave it: the wake empties the allocator's cache
    first (its free blocks are the trainer's), then refuses with what it needs, maps nothing,
    and the engine wakes later, from the same graphs, once the memory is free."""
    backend = ShortBackend()
    engine = engine_on(backend)
    ids, mask = prompts(3)
    first = engine.generate(ids, mask, PARAMS)
    engine.sleep()
    need = engine.memory_held()
    assert engine.sleeping and need > 0
    backend.free, emptied = need - 1, backend.emptied
    with pytest.raises(WakeMemoryError, match=r"GiB again but only .* is free"):
        engine.wake_up() if wake == "wake_up" else engine.generate(ids, mask, PARAMS)
    assert backend.emptied > emptied and engine.sleeping
    backend.free = need
    again = engine.generate(ids, mask, PARAMS)
    assert torch.equal(again.sequences, first.sequences)
    assert not again.stats.captured and again.stats.captures == first.stats.captures
    engine.shutdown()
