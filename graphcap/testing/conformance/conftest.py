"""Fixtures of the conformance checks: the backend under test, narrowed by capability."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from graphcap.backend import Backend
from graphcap.testing.plugin import session_of
from graphcap.testing.report import NO_GRAPHS_PREFIX


def pytest_collection_modifyitems(config: pytest.Config) -> None:
    """Refuse to run the checks without the plugin, which reports and records them."""
    session_of(config)


@pytest.fixture(scope="session")
def gc_backend(request: pytest.FixtureRequest) -> Backend:
    """The backend under test; skips the check (with the reason) when none can be selected."""
    selection = session_of(request.config).selection
    if selection.error is not None:
        raise RuntimeError(
            f"creating backend {selection.requested or '(auto-selected)'} raised "
            f"{type(selection.error).__name__}: {selection.error}"
        ) from selection.error
    if selection.backend is None:
        pytest.skip(selection.skip_reason or "no backend selected")
    return selection.backend


@pytest.fixture(scope="session")
def gc_graph_backend(gc_backend: Backend) -> Backend:
    """The backend, for checks that only apply to backends that capture graphs."""
    if not gc_backend.capabilities.graph_capture:
        if type(gc_backend).graph_capture:
            pytest.fail(
                f"backend {gc_backend.name!r} declares graph_capture=True but create_graph() "
                "returns None: its graph capture regressed (or the declaration is wrong)"
            )
        pytest.skip(
            f"{NO_GRAPHS_PREFIX} backend {gc_backend.name!r} does not capture graphs "
            "(create_graph() returns None); graph checks do not apply and the rollout engine "
            "runs it eagerly"
        )
    return gc_backend


@pytest.fixture(scope="session")
def gc_rng_backend(gc_graph_backend: Backend) -> Backend:
    """The backend, for checks of random sampling inside graphs."""
    if not gc_graph_backend.capabilities.rng_in_graph:
        pytest.skip(
            f"backend {gc_graph_backend.name!r} declares rng_in_graph=False; sampling runs "
            "outside graphs there, so in-graph RNG checks do not apply"
        )
    return gc_graph_backend


@pytest.fixture(autouse=True)
def _gc_no_capture_left_open(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every check must leave the backend outside any capture, whatever it did."""
    yield
    backend = session_of(request.config).selection.backend
    if backend is not None and backend.is_current_stream_capturing():
        pytest.fail("a capture was left open: is_current_stream_capturing() is still True")
