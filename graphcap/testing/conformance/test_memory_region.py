"""Memory regions (for backends whose ``memory_region()`` hands one out: the capability
``keeps_addresses_on_release``): a sleep gives the memory back and the graphs replay after it.

A graph captured in a region, its inputs and outputs allocated there, must replay after a
release and restore with the same addresses: kept contents come back, the graph's own memory
needs none, and the device's free-memory report rises by what the region held while it is
released. Then the engine's own loop: a sleep between calls keeps the graph, and the tokens
equal those of an engine that never slept.
"""

from __future__ import annotations

import copy

import pytest
import torch

from graphcap.backend import Backend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.holder.capture import capture_step
from graphcap.testing import models

#: A region this large shows in any device's free-memory report over its noise.
BIG = 64 << 20


@pytest.fixture(scope="session")
def gc_region_backend(gc_graph_backend: Backend) -> Backend:
    """The backend, for checks of the memory regions it hands out."""
    if not gc_graph_backend.capabilities.keeps_addresses_on_release:
        pytest.skip(
            f"backend {gc_graph_backend.name!r} hands out no memory region "
            "(keeps_addresses_on_release=False): engines free their memory at a sleep and "
            "capture again after it"
        )
    return gc_graph_backend


def test_a_graph_replays_after_release_and_restore(gc_region_backend: Backend) -> None:
    backend, device = gc_region_backend, gc_region_backend.device
    region = backend.memory_region()
    try:
        with region.allocating(keep=True):
            kept = torch.arange(1024, dtype=torch.float32, device=device)
            out = torch.zeros(1024, device=device)
        with region.allocating(keep=False):
            scratch = torch.ones(BIG // 4, device=device)
        addresses = (kept.data_ptr(), out.data_ptr(), scratch.data_ptr())

        def step() -> None:
            out.copy_(kept * 2 + 1)

        pool = region.graph_pool()
        graph = capture_step(backend, step, [out], None, pool=pool, memory=region.capturing)
        held = region.nbytes()
        assert held >= BIG, f"the region holds {held} bytes, less than it allocated"
        backend.synchronize()
        before = backend.free_memory()
        region.release()
        backend.empty_cache()
        backend.synchronize()
        after = backend.free_memory()
        assert region.released
        if before is not None and after is not None and device.type != "cpu":
            assert after - before >= 0.9 * BIG, (
                f"the device reported {after - before} more bytes free after the release, "
                f"not the {BIG} of its K/V-like allocation"
            )
        region.restore()
        assert (kept.data_ptr(), out.data_ptr(), scratch.data_ptr()) == addresses
        assert torch.equal(kept, torch.arange(1024, dtype=torch.float32, device=device))
        backend.replay_graph(graph)
        backend.synchronize()
        assert torch.equal(out, kept * 2 + 1)
    finally:
        region.close()


def test_an_engine_sleeping_between_calls_replays_its_graph(gc_region_backend: Backend) -> None:
    backend = gc_region_backend
    model = models.build(models.MODELS[0], backend.device)
    ids, mask = models.prompts(3, backend.device)
    params = SamplingParams(max_new_tokens=6, eos_token_id=[])
    config = RolloutConfig(enable_graph_capture=True, backend=backend)
    engine, awake = RolloutEngine(model, config), RolloutEngine(model, config)
    try:
        first = engine.generate(ids, mask, params)
        expected = awake.generate(ids, mask, params)
        for _ in range(2):
            engine.sleep()
            assert engine.sleeping and engine.last_sleep.kept_graphs
            again = engine.generate(ids, mask, params)
            assert not again.stats.captured, again.stats.recapture_reason
            assert again.stats.captures == first.stats.captures
            assert torch.equal(again.sequences, expected.sequences)
    finally:
        engine.shutdown()
        awake.shutdown()


def test_an_engine_asleep_or_shut_down_leaves_another_engines_graphs_running(
    gc_region_backend: Backend,
) -> None:
    """Two engines in one process (a trainer's drop-in beside a reference, a benchmark's
    modes): what the first engine's capture made once for the process (a kernel's scratch
    buffer) must not live in its region, which its sleep unmaps and its shutdown gives back
    for good while the other's graphs still run."""
    backend = gc_region_backend
    model = models.build(models.MODELS[0], backend.device)
    twin = copy.deepcopy(model)
    ids, mask = models.prompts(3, backend.device)
    params = SamplingParams(max_new_tokens=6, eos_token_id=[])
    config = RolloutConfig(enable_graph_capture=True, backend=backend)
    engine, other = RolloutEngine(model, config), RolloutEngine(twin, config)
    try:
        first = engine.generate(ids, mask, params)
        engine.sleep()
        second = other.generate(ids, mask, params)  # captured while the first is asleep
        backend.synchronize()
        assert second.stats.path == first.stats.path and second.stats.captured
        assert torch.equal(second.sequences, first.sequences)
        engine.shutdown()
        third = other.generate(ids, mask, params)
        backend.synchronize()
        assert not third.stats.captured and torch.equal(third.sequences, first.sequences)
    finally:
        engine.shutdown()
        other.shutdown()
