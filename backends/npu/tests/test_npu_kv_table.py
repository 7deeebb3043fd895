"""GrowableKVTable: growth before capture only, device-side write positions, capacity errors."""

from __future__ import annotations

import pytest
import torch
from graphcap_npu import GrowableKVTable

from graphcap.cpu.backend import CPUBackend
from graphcap.errors import GraphCaptureError

B, H, D = 2, 2, 4


def _kv(steps: int, start: float = 0.0, heads: int = H):
    numel = B * heads * steps * D
    k = torch.arange(start, start + numel).reshape(B, heads, steps, D)
    return k, -k


def _never() -> bool:
    return False


def test_grows_per_layer_from_the_first_kv() -> None:
    table = GrowableKVTable(8, is_capturing=_never)
    assert len(table) == 0
    k, v = _kv(3)
    key_buffer, value_buffer = table.update(k, v, layer_idx=0)
    table.update(*_kv(3, heads=1), layer_idx=5)  # layers need not be contiguous nor alike
    assert list(table) == [0, 5]
    assert key_buffer.shape == (B, H, 8, D)
    assert table.layer(5)[0].shape == (B, 1, 8, D)
    assert torch.equal(key_buffer[:, :, :3], k) and torch.equal(value_buffer[:, :, :3], v)
    assert not key_buffer[:, :, 3:].any()  # zero-filled beyond the writes
    assert table.positions is not None and table.positions.shape == (1,)
    assert table.nbytes == 2 * (B * H * 8 * D + B * 1 * 8 * D) * k.element_size()
    with pytest.raises(KeyError, match="layers seen: \\[0, 5\\]"):
        table.layer(1)


def test_writes_land_at_the_device_position_and_addresses_stay() -> None:
    table = GrowableKVTable(8, is_capturing=_never)
    key_buffer, _ = table.update(*_kv(2), layer_idx=0)
    address = key_buffer.data_ptr()
    table.advance(2)
    k, v = _kv(1, start=100.0)
    key_buffer, value_buffer = table.update(k, v, layer_idx=0)
    assert key_buffer.data_ptr() == address
    assert torch.equal(key_buffer[:, :, 2:3], k) and torch.equal(value_buffer[:, :, 2:3], v)
    assert torch.equal(key_buffer[:, :, :2], _kv(2)[0])
    table.set_positions(6)
    table.update(*_kv(2, start=500.0), layer_idx=0)
    assert torch.equal(key_buffer[:, :, 6:8], _kv(2, start=500.0)[0])


def test_per_row_positions() -> None:
    table = GrowableKVTable(6, is_capturing=_never, per_row=True)
    table.update(*_kv(1), layer_idx=0)
    table.set_positions(torch.tensor([1, 4]))
    k, v = _kv(2, start=50.0)
    key_buffer, value_buffer = table.update(k, v, layer_idx=0)
    assert torch.equal(key_buffer[0, :, 1:3], k[0]) and torch.equal(key_buffer[1, :, 4:6], k[1])
    assert torch.equal(value_buffer[1, :, 4:6], v[1])
    assert not key_buffer[0, :, 3:].any() and not key_buffer[1, :, 1:4].any()


def test_reset_zeroes_in_place() -> None:
    table = GrowableKVTable(4, is_capturing=_never)
    key_buffer, value_buffer = table.update(*_kv(2, start=1.0), layer_idx=0)
    table.advance(2)
    table.reset()
    assert table.layer(0)[0] is key_buffer
    assert not key_buffer.any() and not value_buffer.any()
    assert table.positions is not None and int(table.positions) == 0


def test_growth_while_capturing_is_refused() -> None:
    capturing = [False]
    table = GrowableKVTable(4, is_capturing=lambda: capturing[0])
    table.update(*_kv(1), layer_idx=0)
    capturing[0] = True
    table.update(*_kv(1), layer_idx=0)  # a known layer is fine
    with pytest.raises(GraphCaptureError, match="layer 1 was first seen during a graph capture"):
        table.update(*_kv(1), layer_idx=1)
    assert 1 not in table


def test_capacity_and_shape_errors() -> None:
    table = GrowableKVTable(4, is_capturing=_never)
    with pytest.raises(ValueError, match="exceeds its capacity of 4"):
        table.update(*_kv(5), layer_idx=0)
    table.update(*_kv(3), layer_idx=0)
    table.advance(3)
    with pytest.raises(ValueError, match=r"overflow: writing 2 position\(s\) at positions 3\.\.3"):
        table.update(*_kv(2), layer_idx=0)
    with pytest.raises(ValueError, match="does not fit buffers"):
        table.update(*_kv(1, heads=1), layer_idx=0)
    with pytest.raises(ValueError, match="built for batch 2"):
        table.update(torch.zeros(1, H, 1, D), torch.zeros(1, H, 1, D), layer_idx=1)
    with pytest.raises(ValueError, match="BNSD"):
        table.update(torch.zeros(B, 1, D), torch.zeros(B, 1, D), layer_idx=2)
    with pytest.raises(ValueError, match="at least 1"):
        GrowableKVTable(0, is_capturing=_never)
    with pytest.raises(RuntimeError, match="no layers yet"):
        GrowableKVTable(2, is_capturing=_never).advance()


def test_captured_step_writes_where_positions_point_at_replay() -> None:
    """In a CPU graph: no host position is frozen; the step advances its own position."""
    backend = CPUBackend()
    table = GrowableKVTable(6, is_capturing=backend.is_current_stream_capturing)
    table.update(*_kv(2), layer_idx=0)  # prefill (eager) allocates the layer
    table.advance(2)
    k_in = torch.zeros(B, H, 1, D)
    v_in = torch.zeros(B, H, 1, D)
    graph = backend.create_graph()
    with backend.capture_to_graph(graph):
        table.update(k_in, v_in, layer_idx=0)
        table.advance(1)
        with pytest.raises(GraphCaptureError, match="layer 1 was first seen"):
            table.update(k_in, v_in, layer_idx=1)
    assert int(table.positions) == 2  # capture recorded the step, it did not run it
    for step in range(3):
        k_in.fill_(10.0 + step)
        v_in.fill_(-10.0 - step)
        backend.replay_graph(graph)
    key_buffer, value_buffer = table.layer(0)
    assert int(table.positions) == 5
    assert torch.equal(key_buffer[:, :, :2], _kv(2)[0])
    for step in range(3):
        assert (key_buffer[:, :, 2 + step] == 10.0 + step).all()
        assert (value_buffer[:, :, 2 + step] == -10.0 - step).all()
    assert not key_buffer[:, :, 5].any()
