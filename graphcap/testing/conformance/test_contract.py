"""The Backend contract outside graphs: identity, declared capabilities, device plumbing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphcap.backend import Availability, Backend, Capabilities
from graphcap.errors import GraphUnsupportedError
from graphcap.registry import attention_implementations


def test_identity(gc_backend: Backend) -> None:
    assert isinstance(gc_backend.name, str) and gc_backend.name, "name must be a non-empty str"
    assert isinstance(gc_backend.priority, int)
    device = gc_backend.device
    assert isinstance(device, torch.device)
    assert device.type == gc_backend.device_type, (
        f"device {device} does not match device_type {gc_backend.device_type!r}"
    )
    availability = type(gc_backend).availability()
    assert isinstance(availability, Availability)
    assert availability.ok, "a selected backend must report itself available"
    assert availability.reason.strip(), "availability() must give a reason, even when available"


def test_create_graph_consistent_with_capabilities(gc_backend: Backend) -> None:
    graphs = [gc_backend.create_graph() for _ in range(3)]
    captures = [graph is not None for graph in graphs]
    assert len(set(captures)) == 1, f"create_graph() returned a graph only sometimes: {graphs}"
    capabilities = gc_backend.capabilities
    assert isinstance(capabilities, Capabilities)
    assert capabilities.graph_capture is captures[0]
    if captures[0]:
        assert len({id(graph) for graph in graphs}) == 3, "each create_graph() needs a new graph"
    else:
        assert not capabilities.rng_in_graph, "rng_in_graph declared without graph capture"
        assert not capabilities.collectives_in_graph, (
            "collectives_in_graph declared without graph capture"
        )
    for flag in dataclasses.fields(Capabilities):
        value = getattr(capabilities, flag.name)
        if flag.name == "mask_form":
            assert value in ("additive", "bool"), f"unknown mask_form {value!r}"
        elif flag.name == "graph_attention":
            offered = attention_implementations(gc_backend)
            assert value is None or value in offered, (
                f"graph_attention {value!r} is not among the attention implementations the "
                f"plugin offers ({sorted(offered)})"
            )
        elif flag.name == "kv_block_size":
            assert value is None or (type(value) is int and value > 0), (
                f"kv_block_size must be None (static cache) or a positive int, not {value!r}"
            )
        else:
            assert isinstance(value, bool), f"capability {flag.name} must be a bool, not {value!r}"
    if capabilities.graph_kv_lengths_on_host:
        assert capabilities.kv_block_size is not None, (
            "graph_kv_lengths_on_host declared without kv_block_size: host lengths serve only "
            "block-table steps"
        )


def test_declared_graph_capture_matches_behaviour(gc_backend: Backend) -> None:
    declared = type(gc_backend).graph_capture
    assert isinstance(declared, bool), (
        f"declare whether the backend captures graphs: set the class attribute "
        f"graph_capture = True or False (it is {declared!r})"
    )
    behaves = gc_backend.create_graph() is not None
    assert declared is behaves, (
        f"backend declares graph_capture={declared} but create_graph() "
        f"{'returns a graph' if behaves else 'returns None'}"
    )


def test_graph_hooks_refuse_without_capture(gc_backend: Backend) -> None:
    if gc_backend.capabilities.graph_capture:
        pytest.skip("backend captures graphs; refusal applies only to backends that cannot")
    with pytest.raises(GraphUnsupportedError):
        gc_backend.capture_to_graph(None)
    with pytest.raises(GraphUnsupportedError):
        gc_backend.replay_graph(None)
    assert gc_backend.is_current_stream_capturing() is False


def test_not_capturing_outside_capture(gc_backend: Backend) -> None:
    assert gc_backend.is_current_stream_capturing() is False


def test_synchronize_and_streams(gc_backend: Backend) -> None:
    x = torch.arange(16.0, device=gc_backend.device)
    y = x * 2
    gc_backend.synchronize()
    assert gc_backend.current_stream() is not None
    assert torch.equal(y.cpu(), torch.arange(16.0) * 2)
    if not gc_backend.capture_needs_side_stream:
        return
    # The rollout engine warms up and captures on a side stream joined to the current one.
    side = gc_backend.new_stream()
    side.wait_stream(gc_backend.current_stream())
    with gc_backend.stream(side):
        z = y + 1
    gc_backend.current_stream().wait_stream(side)
    gc_backend.synchronize()
    assert torch.equal(z.cpu(), torch.arange(16.0) * 2 + 1)


def test_rng_state_round_trip(gc_backend: Backend) -> None:
    gc_backend.manual_seed(1234)
    state = gc_backend.get_rng_state()
    first = torch.rand(64, device=gc_backend.device).cpu()
    second = torch.rand(64, device=gc_backend.device).cpu()
    assert not torch.equal(first, second), "the generator did not advance between draws"
    gc_backend.set_rng_state(state)
    assert torch.equal(torch.rand(64, device=gc_backend.device).cpu(), first)
    gc_backend.manual_seed(1234)
    assert torch.equal(torch.rand(64, device=gc_backend.device).cpu(), first)


def test_memory_figures(gc_backend: Backend) -> None:
    allocated = gc_backend.memory_allocated()
    peak = gc_backend.max_memory_allocated()
    if gc_backend.device_type == "cpu":
        # torch keeps no allocator figures for the CPU; the engine then reports none.
        assert allocated is None and peak is None, (
            "a CPU backend reports memory figures torch does not keep: return None"
        )
        return
    assert isinstance(allocated, int) and allocated >= 0, (
        f"memory_allocated() must be an int on a {gc_backend.device_type} device, not "
        f"{allocated!r} (the bench and the recapture-memory checks read it)"
    )
    gc_backend.reset_peak_memory_stats()
    before = gc_backend.memory_allocated()
    block = torch.empty(1 << 20, dtype=torch.uint8, device=gc_backend.device)
    assert gc_backend.memory_allocated() >= before + block.numel()
    assert gc_backend.max_memory_allocated() >= gc_backend.memory_allocated()
    del block
    gc_backend.empty_cache()


def test_communication_backend_name(gc_backend: Backend) -> None:
    """The name must be a torch.distributed backend that serves this device type (once the
    device's library is loaded, which selecting the backend has done)."""
    import torch.distributed as dist

    name = gc_backend.communication_backend_name()
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    assert name in dist.Backend.backend_list, (
        f"communication_backend_name() is {name!r}, which torch.distributed does not know "
        f"({dist.Backend.backend_list})"
    )
    devices = dist.Backend.backend_capability.get(name, [])
    assert gc_backend.device_type in devices, (
        f"torch.distributed backend {name!r} serves {devices}, not {gc_backend.device_type!r}"
    )
