"""The rollout engine on the backend under test, through its public API only.

Tiny GPT-2 and Llama models (2 layers), 3 left-padded prompts, 8 new tokens: each path the
engine offers (static graph, continuous slots, per-position graphs) must give the tokens of the
eager engine, capture once across calls, and a failed capture must roll back and finish eagerly.
What the engine did is read from ``result.stats`` (path, captures, replays, fallback_reason).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch

from graphcap.backend import Backend
from graphcap.errors import GraphCaptureError
from graphcap.rollout import (
    CaptureFallbackWarning,
    RolloutConfig,
    RolloutEngine,
    RolloutResult,
    SamplingParams,
)
from graphcap.rollout.plan import DecodePath
from graphcap.rollout.plan.fusion import joinable_groups
from graphcap.testing import models

BATCH, NEW_TOKENS, SEED = 3, 8, 5


def _params(sample: bool, **extra: object) -> SamplingParams:
    if sample:
        extra.update(do_sample=True, temperature=0.9, seed=SEED)
    return SamplingParams(max_new_tokens=NEW_TOKENS, return_logprobs=True, **extra)


def _generate(
    backend: Backend,
    model: torch.nn.Module,
    params: SamplingParams,
    calls: int = 1,
    explicit_generator: bool = False,
    **config: object,
) -> list[RolloutResult]:
    """``calls`` identical requests on one engine (so later calls reuse its graphs); eager
    unless ``config`` sets ``enable_graph_capture``."""
    config = {"enable_graph_capture": False, **config}
    engine = RolloutEngine(model, RolloutConfig(backend=backend, **config))
    ids, mask = models.prompts(BATCH, backend.device)
    generator = torch.Generator(device=backend.device) if explicit_generator else None
    try:
        return [engine.generate(ids, mask, params, generator=generator) for _ in range(calls)]
    finally:
        engine.shutdown()


def _same_tokens(result: RolloutResult, reference: RolloutResult, what: str) -> None:
    assert torch.equal(result.sequences.cpu(), reference.sequences.cpu()), (
        f"{what}: tokens differ from the eager engine's\n{result.sequences}\n{reference.sequences}"
    )
    assert result.logprobs is not None and reference.logprobs is not None
    torch.testing.assert_close(
        result.logprobs.cpu(), reference.logprobs.cpu(), rtol=1e-4, atol=1e-4
    )


@pytest.fixture(scope="module", params=list(models.MODELS))
def model(request: pytest.FixtureRequest, gc_backend: Backend) -> torch.nn.Module:
    return models.build(request.param, gc_backend.device)


@pytest.mark.parametrize(
    ("sample", "explicit_generator"),
    [(False, False), (True, False), (True, True)],
    ids=["greedy", "sampled", "sampled-generator"],
)
def test_static_graph_equals_eager_one_capture(
    gc_graph_backend: Backend, model: torch.nn.Module, sample: bool, explicit_generator: bool
) -> None:
    backend = gc_graph_backend
    params = _params(sample)
    (eager,) = _generate(backend, model, params, explicit_generator=explicit_generator)
    assert eager.stats.path == "eager"
    first, second = _generate(
        backend, model, params, 2, explicit_generator, enable_graph_capture=True
    )
    if sample and not backend.capabilities.rng_in_graph:
        # Declared rng_in_graph=False: the engine must keep sampling out of graphs, and say so.
        for result in (first, second):
            assert not DecodePath(result.stats.path).is_graph, (
                "backend declares rng_in_graph=False, yet a sampled call replayed a graph"
            )
            assert result.stats.fallback_reason, "sampled call ran eagerly with no reason given"
            _same_tokens(result, eager, "sampled call on a backend without in-graph RNG")
        return
    assert first.stats.path == "static_graph", first.stats.fallback_reason
    # one graph per batch size the call ran (the live-row ladder follows rows that ended)
    sizes = max(1, len(first.stats.batch_steps))
    assert first.stats.captures == sizes and first.stats.replays > 0
    assert second.stats.captures == sizes, "the second identical call captured again"
    assert second.stats.replays > 0
    _same_tokens(first, eager, "first graph call")
    _same_tokens(second, eager, "second graph call (replaying the first call's graph)")


@pytest.mark.parametrize("compile", [None, False], ids=["default", "uncompiled"])
def test_default_config_compiles_as_declared(
    gc_graph_backend: Backend, model: torch.nn.Module, compile: bool | None
) -> None:
    """``RolloutConfig(compile=None)``, the default, compiles captured steps exactly where the
    backend declares ``compile_by_default`` (and ``compile=False`` never does); compiled or
    not, the tokens are the eager engine's."""
    backend = gc_graph_backend
    params = _params(False)
    (eager,) = _generate(backend, model, params)
    (result,) = _generate(backend, model, params, enable_graph_capture=True, compile=compile)
    assert result.stats.path == "static_graph", result.stats.fallback_reason
    declared = compile is None and backend.capabilities.compile_by_default
    assert result.stats.compiled is declared, (
        f"compile={compile}: stats.compiled={result.stats.compiled}, but the backend declares "
        f"compile_by_default={backend.capabilities.compile_by_default}"
    )
    _same_tokens(result, eager, f"captured step (compile={compile})")


@pytest.mark.parametrize("fuse", [None, False], ids=["default", "unjoined"])
def test_default_config_joins_projections_as_declared(
    gc_graph_backend: Backend, model: torch.nn.Module, fuse: bool | None
) -> None:
    """``RolloutConfig(fuse_projections=None)``, the default, joins q/k/v and gate/up in a
    graph engine exactly where the backend declares ``fuse_projections_by_default`` (and
    ``False`` never does); joined or not, the tokens are the eager engine's."""
    backend, model = gc_graph_backend, copy.deepcopy(model)  # joining makes parameters views
    params = _params(False)
    (eager,) = _generate(backend, model, params)
    (result,) = _generate(backend, model, params, enable_graph_capture=True, fuse_projections=fuse)
    declared = fuse is None and backend.capabilities.fuse_projections_by_default
    expected = len(joinable_groups(model)) if declared else 0
    assert result.stats.fused_projections == expected, (
        f"fuse_projections={fuse}: {result.stats.fused_projections} groups joined, expected "
        f"{expected} (fuse_projections_by_default="
        f"{backend.capabilities.fuse_projections_by_default})"
    )
    _same_tokens(result, eager, f"captured step (fuse_projections={fuse})")


def test_continuous_graph_equals_eager(gc_graph_backend: Backend, model: torch.nn.Module) -> None:
    backend = gc_graph_backend
    params = _params(False)
    (eager,) = _generate(backend, model, params)
    (result,) = _generate(
        backend, model, params, enable_graph_capture=True, continuous_batch_size=2
    )
    assert result.stats.path == "continuous_graph", result.stats.fallback_reason
    # one graph per batch size the call ran (the live-row ladder, once the queue is empty)
    sizes = max(1, len(result.stats.batch_steps))
    assert result.stats.captures == sizes and result.stats.replays > 0
    _same_tokens(result, eager, "continuous graph path (2 slots, 3 prompts)")


def test_per_position_graphs_equal_eager(gc_graph_backend: Backend, model: torch.nn.Module) -> None:
    backend = gc_graph_backend
    params = _params(False, min_new_tokens=NEW_TOKENS)
    (eager,) = _generate(backend, model, params)
    first, second = _generate(
        backend, model, params, 2, enable_graph_capture=True, per_position_graphs=True
    )
    assert first.stats.path == "per_position_graph", first.stats.fallback_reason
    assert first.stats.captures == NEW_TOKENS - 1, "one graph per decode position"
    assert second.stats.captures == first.stats.captures, "the second call captured again"
    _same_tokens(first, eager, "per-position graphs")
    _same_tokens(second, eager, "per-position graphs, second call")


def _failing_capture(backend: Backend) -> Backend:
    """A copy of ``backend`` whose captures record normally and then fail, as a device that
    rejects the graph at the end of capture would."""
    failing = copy.copy(backend)
    real = backend.capture_to_graph

    @contextlib.contextmanager
    def capture_to_graph(graph: object, *args: object, **kwargs: object) -> Iterator[None]:
        with real(graph, *args, **kwargs):
            yield
        raise GraphCaptureError("injected by the conformance suite: capture rejected")

    failing.capture_to_graph = capture_to_graph  # type: ignore[method-assign]
    return failing


def test_failed_capture_rolls_back_and_finishes_eagerly(
    gc_graph_backend: Backend, model: torch.nn.Module
) -> None:
    backend = gc_graph_backend
    params = _params(False)
    (eager,) = _generate(backend, model, params)
    with pytest.warns(CaptureFallbackWarning, match="injected by the conformance suite"):
        first, second = _generate(
            _failing_capture(backend), model, params, 2, enable_graph_capture=True
        )
    assert first.stats.path == "eager" and first.stats.replays == 0
    assert first.stats.fallback_reason and "injected" in first.stats.fallback_reason
    _same_tokens(first, eager, "call whose capture failed (buffers not rolled back?)")
    assert second.stats.captures == 0 and second.stats.path == "eager"
    _same_tokens(second, eager, "call after a failed capture")
