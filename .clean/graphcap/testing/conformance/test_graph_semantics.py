"""What a graph must do for the rollout engine: record at capture, re-run on the same memory.

Every capture goes through the engine's ``capture_step``: the step is warmed up once (its effects
on ``mutable`` undone), then recorded. Steps keep what they allocate in ``out`` so the check can
read the tensors the captured run writes.
"""

from __future__ import annotations

import torch

from graphcap.backend import Backend
from graphcap.rollout.holder.capture import capture_step
from graphcap.testing.conformance.replay import replay

#: Enough replays to catch a graph that stops (or changes) after a few dozen: the engine replays
#: one graph thousands of times over a training run.
MANY_REPLAYS = 300


def _values(*tensors: torch.Tensor) -> list[list[float]]:
    return [tensor.cpu().tolist() for tensor in tensors]


def test_capture_records_without_executing(gc_graph_backend: Backend) -> None:
    backend = gc_graph_backend
    x = torch.arange(1.0, 9.0, device=backend.device)
    total = torch.zeros(8, device=backend.device)
    out: dict[str, torch.Tensor] = {}

    def step() -> None:
        total.add_(x)
        out["doubled"] = x * 2

    # ``total`` is left out of the rollback on purpose: the warm-up adds x once, the capture
    # must add nothing.
    graph = capture_step(backend, step, [], None)
    assert _values(total, x) == _values(torch.arange(1.0, 9.0), torch.arange(1.0, 9.0)), (
        "capture changed memory that existed before it: the work ran instead of being recorded"
    )
    replay(backend, graph)
    assert _values(total, out["doubled"]) == _values(
        torch.arange(1.0, 9.0) * 2, torch.arange(1.0, 9.0) * 2
    )


def test_replay_reexecutes_on_same_memory(gc_graph_backend: Backend) -> None:
    backend = gc_graph_backend
    x = torch.arange(4.0, device=backend.device)
    buffer = torch.zeros(4, device=backend.device)
    out: dict[str, torch.Tensor] = {}

    def step() -> None:
        buffer.copy_(x * 3)
        out["result"] = buffer + 1

    graph = capture_step(backend, step, [buffer], None)
    result = out["result"]
    addresses = (buffer.data_ptr(), result.data_ptr())
    for _ in range(3):
        buffer.zero_()
        result.zero_()
        replay(backend, graph)
        assert (buffer.data_ptr(), result.data_ptr()) == addresses
        assert _values(buffer, result) == _values(
            torch.arange(4.0) * 3, torch.arange(4.0) * 3 + 1
        ), "replay did not write its results into the memory recorded at capture"


def test_replay_reads_inputs_updated_in_place(gc_graph_backend: Backend) -> None:
    backend = gc_graph_backend
    x = torch.ones(6, device=backend.device)
    out: dict[str, torch.Tensor] = {}

    def step() -> None:
        out["result"] = torch.relu(x * 2 - 1)

    graph = capture_step(backend, step, [], None)
    for value in (3.0, -4.0, 0.75):
        x.fill_(value)
        replay(backend, graph)
        expected = max(value * 2 - 1, 0.0)
        assert out["result"].cpu().tolist() == [expected] * 6, (
            f"replay after x.fill_({value}) gave {out['result'].cpu().tolist()}: the graph did "
            "not read the input's current contents (a value frozen at capture?)"
        )


def test_replays_accumulate(gc_graph_backend: Backend) -> None:
    """Hundreds of replays: a graph that stops, or drifts, after a few is caught."""
    backend = gc_graph_backend
    step_size = torch.tensor([1.0, -2.0, 0.5]).to(backend.device)
    position = torch.zeros(3, device=backend.device)
    count = torch.zeros((), dtype=torch.long, device=backend.device)

    def step() -> None:
        position.add_(step_size)
        count.add_(1)

    graph = capture_step(backend, step, [position, count], None)
    replay(backend, graph, times=5)
    assert position.cpu().tolist() == [5.0, -10.0, 2.5], (
        "5 replays of an in-place update must apply it 5 times"
    )
    for done in range(5, MANY_REPLAYS, 59):
        replay(backend, graph, times=59)
        assert int(count.cpu()) == done + 59, (
            f"after {done + 59} replays the graph ran {int(count.cpu())} times: replays stopped "
            "or were dropped"
        )
    total = int(count.cpu())
    assert position.cpu().tolist() == [total * 1.0, total * -2.0, total * 0.5]


def test_two_graphs_share_a_pool(gc_graph_backend: Backend) -> None:
    backend = gc_graph_backend
    pool = backend.graph_pool_handle()
    x = torch.arange(5.0, device=backend.device)
    out: dict[str, torch.Tensor] = {}

    def first() -> None:
        out["shifted"] = x + 1

    graph_a = capture_step(backend, first, [], None, pool=pool)
    shifted = out["shifted"]

    def second() -> None:
        out["scaled"] = shifted * 3

    graph_b = capture_step(backend, second, [], None, pool=pool)
    scaled = out["scaled"]
    replay(backend, graph_a)
    replay(backend, graph_b)
    assert _values(shifted, scaled) == _values(torch.arange(5.0) + 1, (torch.arange(5.0) + 1) * 3)
    # Replaying one graph must not overwrite the other's live output (no aliasing in the pool).
    x.fill_(10.0)
    replay(backend, graph_a)
    assert _values(shifted, scaled) == _values(torch.full((5,), 11.0), (torch.arange(5.0) + 1) * 3)
    replay(backend, graph_b)
    assert scaled.cpu().tolist() == [33.0] * 5


def test_is_current_stream_capturing_only_inside_capture(gc_graph_backend: Backend) -> None:
    backend = gc_graph_backend
    x = torch.ones(2, device=backend.device)
    assert backend.is_current_stream_capturing() is False
    seen: list[bool] = []
    out: dict[str, torch.Tensor] = {}

    def step() -> None:
        seen.append(backend.is_current_stream_capturing())
        out["result"] = x + 1

    graph = capture_step(backend, step, [], None)
    assert seen == [False, True], (
        "is_current_stream_capturing() must be False in the warm-up and True inside the capture"
    )
    assert backend.is_current_stream_capturing() is False, "still 'capturing' after the capture"
    replay(backend, graph)
    assert backend.is_current_stream_capturing() is False, "replay must not count as capture"
    assert out["result"].cpu().tolist() == [2.0, 2.0]
