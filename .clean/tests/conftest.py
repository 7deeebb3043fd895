"""Tests here run on the CPU reference backend, whatever ``GRAPHCAP_BACKEND`` says.

The tox ``cuda`` and ``npu`` environments set ``GRAPHCAP_BACKEND`` to their device; only tests
marked ``device`` use it (through the ``requested_backend`` fixture). Every other test sees
``cpu``, so a CPU test never silently runs on, or fails for want of, an accelerator.
"""

from __future__ import annotations

import os

import pytest

from graphcap.registry import ENV_VAR

REQUESTED_BACKEND = os.environ.get(ENV_VAR) or None


@pytest.fixture(autouse=True)
def _cpu_unless_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("device") is None:
        monkeypatch.setenv(ENV_VAR, "cpu")


@pytest.fixture(scope="session")
def requested_backend() -> str | None:
    """The backend named by ``GRAPHCAP_BACKEND`` when the session started (device tests)."""
    return REQUESTED_BACKEND
