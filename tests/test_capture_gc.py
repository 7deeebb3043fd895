"""A capture's entry collection scans young objects only (graphcap.backend.SHIELD_OLD_OBJECTS).

torch.cuda's ``graph(...)`` runs ``gc.collect()`` on entry; the library below does the same
around the CPU reference graphs, and records what that collection could reach.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import graphcap.backend
from graphcap.cpu import CPUBackend
from graphcap.cpu.graph import ReferenceGraphs
from graphcap.errors import GraphCaptureError


class CollectingGraphs(ReferenceGraphs):
    """The reference graphs with torch.cuda's entry: a full collection, seen by ``entries``."""

    entries: list[dict[str, Any]] = []
    fail_on_entry = False

    @staticmethod
    @contextlib.contextmanager
    def graph(graph: Any, **kwargs: Any) -> Iterator[None]:
        gc.collect()
        CollectingGraphs.entries.append({"frozen": gc.get_freeze_count()})
        if CollectingGraphs.fail_on_entry:
            raise RuntimeError("capture refused")
        with ReferenceGraphs.graph(graph, **kwargs):
            yield


class CollectingBackend(CPUBackend):
    def graph_library(self) -> type[ReferenceGraphs]:
        return CollectingGraphs


class Cycle:
    """Garbage only a collection frees (it refers to itself)."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def backend() -> Iterator[CollectingBackend]:
    CollectingGraphs.entries = []
    CollectingGraphs.fail_on_entry = False
    assert gc.get_freeze_count() == 0, "an earlier test left objects frozen"
    yield CollectingBackend()
    gc.unfreeze()


def capture_doubling(backend: CollectingBackend) -> torch.Tensor:
    x = torch.ones(2)
    graph = backend.create_graph()
    with backend.capture_to_graph(graph):
        CollectingGraphs.entries[-1]["frozen_in_step"] = gc.get_freeze_count()
        y = x * 2
    x.fill_(3.0)
    backend.replay_graph(graph)
    return y


def test_older_objects_are_frozen_only_while_the_capture_begins(backend):
    y = capture_doubling(backend)
    assert torch.equal(y, torch.full((2,), 6.0))  # the capture itself is unchanged
    (entry,) = CollectingGraphs.entries
    assert entry["frozen"] > 1000  # the interpreter's, torch's, this test's objects
    assert entry["frozen_in_step"] == 0  # the captured step's collections see everything
    assert gc.get_freeze_count() == 0


def test_young_garbage_is_still_collected_before_capture(backend):
    cycle = Cycle()
    alive = weakref.ref(cycle)
    del cycle
    graph = backend.create_graph()
    with backend.capture_to_graph(graph):
        assert alive() is None


def test_a_process_that_froze_objects_keeps_them_frozen(backend):
    gc.freeze()
    frozen = gc.get_freeze_count()
    capture_doubling(backend)
    assert CollectingGraphs.entries[0]["frozen"] == frozen
    assert gc.get_freeze_count() == frozen


def test_turned_off_the_entry_collection_sees_every_object(backend, monkeypatch):
    monkeypatch.setattr(graphcap.backend, "SHIELD_OLD_OBJECTS", False)
    capture_doubling(backend)
    assert CollectingGraphs.entries[0]["frozen"] == 0


def test_a_refused_capture_leaves_nothing_frozen(backend):
    CollectingGraphs.fail_on_entry = True
    with pytest.raises(GraphCaptureError, match="capture refused"):
        capture_doubling(backend)
    assert gc.get_freeze_count() == 0
