"""What a graph must do for the rollout engine: record at capture, re-run on the same memory."""

from __future__ import annotations

import torch

from graphcap.backend import Backend
from graphcap.testing.graphs import capture, replay, warm_up


def _values(*tensors: torch.Tensor) -> list[list[float]]:
    return [tensor.cpu().tolist() for tensor in tensors]


def test_capture_records_without_executing(gc_graph_backend: Backend) -> None:
    backend = gc_graph_backend
    x = torch.arange(1.0, 9.0, device=backend.device)
    total = torch.zeros(8, device=backend.device)

    def step() -> torch.Tensor:
        total.add_(x)
        return x * 2

    warm_up(backend, step)
    total.zero_()
    backend.synchronize()
    graph, doubled = capture(backend, step)
    # Memory that existed before capture is as it was: nothing ran, or its effects were undone.
    assert _values(total, x) == _values(torch.zeros(8), torch.arange(1.0, 9.0)), (
        "capture changed memory that existed before it: the work ran instead of being recorded"
    )
    replay(backend, graph)
    assert _values(total, doubled) == _values(torch.arange(1.0, 9.0), torch.arange(1.0, 9.0) * 2)


def test_replay_reexecutes_on_same_memory(gc_graph_backend: Backend) -> None:
    backend = gc_graph_backend
    x = torch.arange(4.0, device=backend.device)
    out = torch.zeros(4, device=backend.device)

    def step() -> torch.Tensor:
        out.copy_(x * 3)
        return out + 1

    warm_up(backend, step)
    graph, result = capture(backend, step)
    addresses = (out.data_ptr(), result.data_ptr())
    for _ in range(3):
        out.zero_()
        result.zero_()
        replay(backend, graph)
        assert (out.data_ptr(), result.data_ptr()) == addresses
        assert _values(out, result) == _values(torch.arange(4.0) * 3, torch.arange(4.0) * 3 + 1), (
            "replay did not write its results into the memory recorded at capture"
        )


def test_replay_reads_inputs_updated_in_place(gc_graph_backend: Backend) -> None:
    backend = gc_graph_backend
    x = torch.ones(6, device=backend.device)

    def step() -> torch.Tensor:
        return torch.relu(x * 2 - 1)

    warm_up(backend, step)
    graph, result = capture(backend, step)
    for value in (3.0, -4.0, 0.75):
        x.fill_(value)
        replay(backend, graph)
        expected = max(value * 2 - 1, 0.0)
        assert result.cpu().tolist() == [expected] * 6, (
            f"replay after x.fill_({value}) gave {result.cpu().tolist()}: the graph did not "
            "read the input's current contents (a value frozen at capture?)"
        )


def test_replays_accumulate(gc_graph_backend: Backend) -> None:
    backend = gc_graph_backend
    step_size = torch.tensor([1.0, -2.0, 0.5]).to(backend.device)
    position = torch.zeros(3, device=backend.device)

    def step() -> None:
        position.add_(step_size)

    warm_up(backend, step)
    position.zero_()
    backend.synchronize()
    graph, _ = capture(backend, step)
    replay(backend, graph, times=5)
    assert position.cpu().tolist() == [5.0, -10.0, 2.5], (
        "5 replays of an in-place update must apply it 5 times"
    )


def test_two_graphs_share_a_pool(gc_graph_backend: Backend) -> None:
    backend = gc_graph_backend
    pool = backend.graph_pool_handle()
    x = torch.arange(5.0, device=backend.device)

    def first() -> torch.Tensor:
        return x + 1

    warm_up(backend, first)
    graph_a, shifted = capture(backend, first, pool=pool)

    def second() -> torch.Tensor:
        return shifted * 3

    warm_up(backend, second)
    graph_b, scaled = capture(backend, second, pool=pool)
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
    warm_up(backend, lambda: x + 1)
    assert backend.is_current_stream_capturing() is False
    seen: list[bool] = []

    def step() -> torch.Tensor:
        seen.append(backend.is_current_stream_capturing())
        return x + 1

    graph, result = capture(backend, step)
    assert seen == [True], "is_current_stream_capturing() must be True inside a capture"
    assert backend.is_current_stream_capturing() is False, "still 'capturing' after the capture"
    replay(backend, graph)
    assert backend.is_current_stream_capturing() is False, "replay must not count as capture"
    assert result.cpu().tolist() == [2.0, 2.0]
