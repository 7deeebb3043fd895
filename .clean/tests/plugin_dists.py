"""Throwaway plugin distributions for the registry tests.

Each fake plugin is a module plus a ``*.dist-info`` folder (METADATA, entry_points.txt) on
``sys.path``, which is exactly how ``importlib.metadata`` finds an installed distribution.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from graphcap import registry

BACKEND_MODULE = """
from graphcap import Availability, Backend, hookimpl

class {cls}(Backend):
    name = {name!r}
    priority = {priority}
    device_type = "cpu"

    @classmethod
    def availability(cls):
        return Availability({available}, {reason!r})

@hookimpl
def graphcap_api_version():
    return {api}

@hookimpl
def graphcap_backends():
    return [{cls}]
"""


def install_plugin(
    root: Path, dist: str, module: str, source: str, ep_name: str | None = None
) -> None:
    """Write an installed distribution ``dist`` whose ``graphcap`` entry point is ``module``."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[graphcap]\n{ep_name or module} = {module}\n")


def backend_source(
    name: str, priority: int = 100, available: bool = True, reason: str = "ok", api: int = 1
) -> str:
    return BACKEND_MODULE.format(
        cls=name.capitalize() + "Backend",
        name=name,
        priority=priority,
        available=available,
        reason=reason,
        api=api,
    )


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A folder on sys.path for fake distributions; registry and imports reset around the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("fake_"):
            del sys.modules[name]
    # private: drop the cached registry without rescanning now; the next discover() rescans,
    # once the fake folder is off sys.path
    registry._registry = None
