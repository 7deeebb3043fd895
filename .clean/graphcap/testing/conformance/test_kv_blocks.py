"""The block KV table on the backend under test (for backends that declare ``kv_block_size``).

The continuous path with more requests than slots and per-request budgets: slots retire, their
blocks return to the free list and are handed to newcomers, and a small first pool must grow
between replays (the graph recaptured). The captured steps, with the backend's own graph
attention (block-aware where it offers one), must give the eager engine's tokens on the static
cache, and a backend that takes KV lengths on the host gets them before every replay.
"""

from __future__ import annotations

import pytest
import torch

from graphcap.backend import Backend
from graphcap.rollout import RolloutConfig, RolloutEngine, SamplingParams
from graphcap.rollout.cache.blocks import reads_blocks
from graphcap.testing import models

NEW_TOKENS, SLOTS = 8, 2
LIMITS = [3, 8, 5, 2, 7]


@pytest.fixture(scope="session")
def gc_block_backend(gc_graph_backend: Backend) -> Backend:
    """The backend, for checks of the block table it declares."""
    if gc_graph_backend.capabilities.kv_block_size is None:
        pytest.skip(
            f"backend {gc_graph_backend.name!r} declares no kv_block_size; the engine keeps the "
            "static cache there, so block-table checks do not apply"
        )
    return gc_graph_backend


def _continuous(backend: Backend, model: torch.nn.Module, graph: bool, **config: object):
    engine = RolloutEngine(
        model,
        RolloutConfig(
            backend=backend,
            enable_graph_capture=graph,
            continuous_batch_size=SLOTS,
            eos_check_interval=2,
            **config,
        ),
    )
    ids, mask = models.prompts(len(LIMITS), backend.device)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, eos_token_id=[])
    try:
        return engine.generate(ids, mask, params, request_max_new_tokens=LIMITS)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", models.MODELS)
def test_block_table_graph_equals_eager_with_growth_and_refills(
    gc_block_backend: Backend, name: str
) -> None:
    model = models.build(name, gc_block_backend.device)
    reference = _continuous(gc_block_backend, model, graph=False, kv_block_size=None)
    # one column a block: every step of every row needs a new block, so the pool must grow
    result = _continuous(gc_block_backend, model, graph=True, kv_block_size=1)
    stats = result.stats
    assert stats.path == "continuous_graph", stats.fallback_reason
    assert stats.kv_layout == "blocks" and stats.slots_refilled > 0
    assert stats.kv_pool_growths > 0, "the small first pool never grew"
    assert any(r.startswith("kv_pool_blocks") for r in stats.recapture_reason), (
        f"a pool growth must drop the graph and recapture: {stats.recapture_reason}"
    )
    assert torch.equal(result.sequences.cpu(), reference.sequences.cpu()), (
        f"block table, graph: tokens differ from the eager engine's on the static cache\n"
        f"{result.sequences}\n{reference.sequences}"
    )
    declared = _continuous(gc_block_backend, model, graph=True)  # the backend's own block size
    assert declared.stats.kv_layout == "blocks"
    assert torch.equal(declared.sequences.cpu(), reference.sequences.cpu()), (
        f"block size {gc_block_backend.capabilities.kv_block_size}: tokens differ from eager"
    )


def test_host_lengths_reach_the_backend_before_every_replay(
    gc_block_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a backend that declares ``graph_kv_lengths_on_host`` with a block-aware graph
    attention, every replay follows one ``update_graph_kv_lengths`` call carrying each slot's
    written columns (idle slots 1), first the prompt's width plus one."""
    backend = gc_block_backend
    if not backend.capabilities.graph_kv_lengths_on_host:
        pytest.skip(f"backend {backend.name!r} reads KV lengths on the device")
    seen: list[list[int]] = []
    update = backend.update_graph_kv_lengths

    def recording(graph: object, lengths: list[int]) -> None:
        seen.append(list(lengths))
        update(graph, lengths)

    monkeypatch.setattr(backend, "update_graph_kv_lengths", recording)
    model = models.build("llama", backend.device)
    result = _continuous(backend, model, graph=True)
    stats = result.stats
    assert stats.path == "continuous_graph", stats.fallback_reason
    if not reads_blocks(stats.attention):
        pytest.skip(f"graph attention {stats.attention!r} is not block-aware: no host lengths")
    assert len(seen) == stats.replays > 0, f"{len(seen)} updates for {stats.replays} replays"
    width = models.prompts(len(LIMITS), backend.device)[0].shape[1]
    assert seen[0] == [width + 1] * SLOTS
    longest = width + NEW_TOKENS
    assert all(len(row) == SLOTS and all(1 <= n <= longest for n in row) for row in seen), seen
