"""Fixtures: a fake torch_npu installed in this process, and fake packages for probe processes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import fake_torch_npu
import pytest
import torch
from graphcap_npu import backend as npu_backend
from graphcap_npu.probe import ProbeResult
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from transformers.utils import is_torch_npu_available

if not fake_torch_npu.REAL_TORCH_NPU:
    # transformers caches whether torch_npu is usable the first time it asks (during lazy imports
    # of its attention integrations). Ask now, while no double is installed, so the double never
    # makes transformers take its own NPU code paths.
    assert not is_torch_npu_available()
    assert not is_torch_npu_available(check_device=True)


@pytest.fixture(autouse=True)
def _fresh_availability() -> Iterator[None]:
    """Availability is cached per process; every test starts (and leaves) without a verdict."""
    npu_backend.npu_availability.cache_clear()
    yield
    npu_backend.npu_availability.cache_clear()


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> Iterator[fake_torch_npu.FakeNPUNamespace]:
    """``torch_npu`` and ``torch.npu`` replaced by the documented-semantics test double.

    It counts as already imported, so availability asks the double directly, with no probe;
    its generator rules watch every draw while the test runs.
    """
    if fake_torch_npu.REAL_TORCH_NPU:
        pytest.skip("a real torch_npu is installed here; the double would shadow it")
    module, namespace = fake_torch_npu.make_module()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", namespace, raising=False)
    monkeypatch.setattr(npu_backend, "probe_torch_npu", _no_probe_expected)
    rules = namespace.generator_rules
    rules.__enter__()
    yield namespace
    stack = _get_current_dispatch_mode_stack()
    while rules in stack:  # a test may have left modes above it: they go too
        stack[-1].__exit__(None, None, None)
        stack = _get_current_dispatch_mode_stack()


def _no_probe_expected() -> ProbeResult:
    raise AssertionError("torch_npu is already imported: no child-process probe is needed")


@pytest.fixture
def fake_package(tmp_path: Path):
    """Write a fake ``torch_npu`` package with the given ``__init__`` body; returns its root."""

    def write(body: str) -> Path:
        package = tmp_path / "torch_npu"
        package.mkdir()
        (package / "__init__.py").write_text(body)
        return tmp_path

    return write
