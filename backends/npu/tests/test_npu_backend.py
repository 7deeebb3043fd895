"""NPUBackend against the torch_npu test double: the right API, the right arguments, no no-ops."""

from __future__ import annotations

import sys
from importlib import metadata

import fake_torch_npu
import pytest
import torch
from fake_torch_npu import without_real_torch_npu
from graphcap_npu import (
    ATTENTION_VAR,
    BLOCKS,
    FA3_BNSD,
    FA3_BSH,
    FIAS_BNSD,
    NPUBackend,
    graph_updates,
    plugin,
)
from graphcap_npu import backend as npu_backend
from graphcap_npu.attention import FORWARDS
from graphcap_npu.probe import ProbeResult

from graphcap.cpu.backend import CPUBackend
from graphcap.errors import BackendSelectionError, GraphCaptureError


# ---- without torch_npu (this machine) ---------------------------------------------------------
@without_real_torch_npu
def test_package_import_does_not_import_torch_npu() -> None:
    assert "torch_npu" not in sys.modules
    assert not hasattr(torch, "npu")


@without_real_torch_npu
def test_unavailable_here_with_reason() -> None:
    availability = NPUBackend.availability()
    assert not availability.ok
    assert "torch_npu is not installed" in availability.reason
    assert "torch_npu" not in sys.modules


def test_failed_probe_keeps_torch_npu_out_of_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(npu_backend, "torch_npu_installed", lambda: True)
    monkeypatch.setattr(
        npu_backend, "probe_torch_npu", lambda: ProbeResult(False, "CANN is missing (probe)")
    )
    imported: list[str] = []
    monkeypatch.setattr(npu_backend.importlib, "import_module", imported.append)
    availability = NPUBackend.availability()
    assert not availability.ok
    assert availability.reason == "CANN is missing (probe)"
    assert imported == []


def test_successful_probe_then_imports_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    module, namespace = fake_torch_npu.make_module(device_count=2)
    monkeypatch.setattr(npu_backend, "torch_npu_installed", lambda: True)
    monkeypatch.setattr(
        npu_backend, "probe_torch_npu", lambda: ProbeResult(True, "2 NPU device(s) (probe)", 2)
    )

    def import_module(name: str) -> object:
        assert name == "torch_npu"
        monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(torch, "npu", namespace, raising=False)
        return module

    monkeypatch.setattr(npu_backend.importlib, "import_module", import_module)
    availability = NPUBackend.availability()
    assert availability.ok
    assert availability.reason == "2 NPU device(s) (probe)"
    assert sys.modules["torch_npu"] is module


def test_in_process_import_that_exits_is_contained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(npu_backend, "torch_npu_installed", lambda: True)
    monkeypatch.setattr(npu_backend, "probe_torch_npu", lambda: ProbeResult(True, "ok", 1))

    def import_module(name: str) -> object:
        raise SystemExit(1)

    monkeypatch.setattr(npu_backend.importlib, "import_module", import_module)
    availability = NPUBackend.availability()
    assert not availability.ok
    assert "not here: SystemExit" in availability.reason


def test_availability_is_probed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(npu_backend, "torch_npu_installed", lambda: True)
    calls: list[int] = []

    def probe() -> ProbeResult:
        calls.append(1)
        return ProbeResult(False, "no device")

    monkeypatch.setattr(npu_backend, "probe_torch_npu", probe)
    for _ in range(3):
        assert not NPUBackend.availability().ok
    assert len(calls) == 1


@without_real_torch_npu
def test_graph_hooks_refuse_loudly_when_unavailable() -> None:
    backend = NPUBackend()
    with pytest.raises(BackendSelectionError, match="torch_npu is not installed"):
        backend.create_graph()
    with pytest.raises(BackendSelectionError, match="torch_npu is not installed"):
        backend.capture_to_graph(object())
    assert backend.is_current_stream_capturing() is False


def test_entry_point_is_installed_and_loads() -> None:
    (entry,) = [ep for ep in metadata.entry_points(group="graphcap") if ep.name == "npu"]
    assert entry.value == "graphcap_npu.plugin"
    assert entry.dist is not None and entry.dist.metadata["Name"] == "graphcap-npu"
    assert entry.load() is plugin


@without_real_torch_npu
def test_registry_discovers_the_backend() -> None:
    from graphcap.registry import discover

    registry = discover(refresh=True)
    record = registry.backends["npu"]
    assert record.cls is NPUBackend
    assert record.distribution == "graphcap-npu"
    assert not record.availability().ok
    assert NPUBackend.priority > CPUBackend.priority


def test_attention_offered_only_to_the_npu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    assert plugin.graphcap_attention_implementations(CPUBackend()) == {}
    offered = plugin.graphcap_attention_implementations(NPUBackend())
    assert offered == {name: FORWARDS[name] for name in (BLOCKS, FA3_BSH, FA3_BNSD)}
    # The half-precision inference kernel is offered when the backend was told to use it.
    chosen = plugin.graphcap_attention_implementations(NPUBackend(attention=FIAS_BNSD))
    assert chosen == {**offered, FIAS_BNSD: FORWARDS[FIAS_BNSD]}
    assert plugin.graphcap_backends() == [NPUBackend]


def test_graph_attention_defaults_to_paged_and_is_selectable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ATTENTION_VAR, raising=False)
    assert NPUBackend().graph_attention == BLOCKS
    assert NPUBackend(attention=FA3_BNSD).graph_attention == FA3_BNSD
    monkeypatch.setenv(ATTENTION_VAR, FA3_BNSD)
    assert NPUBackend().graph_attention == FA3_BNSD
    assert NPUBackend(attention=FA3_BSH).graph_attention == FA3_BSH  # the argument wins
    assert NPUBackend.graph_attention == BLOCKS  # the class default is untouched
    monkeypatch.setenv(ATTENTION_VAR, "sdpa")
    with pytest.raises(ValueError, match=f"{ATTENTION_VAR}='sdpa' is not a graphcap_npu"):
        NPUBackend()
    with pytest.raises(ValueError, match="attention='bnsd' is not a graphcap_npu attention"):
        NPUBackend(attention="bnsd")


# ---- with the torch_npu double ----------------------------------------------------------------
def test_already_imported_torch_npu_needs_no_probe(fake_npu) -> None:
    availability = NPUBackend.availability()
    assert availability.ok, availability.reason
    assert availability.reason == "1 NPU device(s) visible (torch_npu imported)"


def test_no_device_in_process(fake_npu, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    fake_npu.visible_devices = 0
    availability = NPUBackend.availability()
    assert not availability.ok
    assert "sees no device (ASCEND_RT_VISIBLE_DEVICES='')" in availability.reason


def test_capabilities(fake_npu) -> None:
    caps = NPUBackend().capabilities
    assert caps.graph_capture is True  # derived from create_graph() handing out a graph
    assert caps.mask_form == "bool"
    assert caps.capture_needs_side_stream is True
    assert caps.rng_in_graph is True
    assert caps.collectives_in_graph is False
    assert caps.graph_attention == BLOCKS
    assert caps.kv_block_size == 128  # torch_npu's recommended page-attention block
    assert caps.graph_kv_lengths_on_host is True
    # no memory region (docs/npu.md, "Sleep and memory regions"): sleeps free and recapture
    assert caps.keeps_addresses_on_release is False


def test_create_graph_is_a_real_npu_graph(fake_npu) -> None:
    graph = NPUBackend().create_graph()
    assert isinstance(graph, fake_npu.NPUGraph)


def test_capture_passes_keywords_in_torch_npu_order(fake_npu) -> None:
    backend = NPUBackend()
    graph = backend.create_graph()
    pool = backend.graph_pool_handle()
    side = backend.new_stream()
    assert not backend.is_current_stream_capturing()
    with backend.capture_to_graph(graph, pool=pool, stream=side, capture_error_mode="relaxed"):
        assert backend.is_current_stream_capturing()
        assert backend.current_stream() is side
    assert not backend.is_current_stream_capturing()
    assert backend.current_stream() is fake_npu.default
    (call,) = fake_npu.graph_calls
    assert call["graph"] is graph
    assert call["pool"] == ("pool", "handle")
    assert call["stream"] is side
    assert call["capture_error_mode"] == "relaxed"
    # no capture runs whole under the dispatch mode: each call it records waits for an update
    # at every replay (graph_updates)
    assert call["auto_dispatch_capture"] is False
    assert graph.events == [
        ("capture_begin", {"pool": ("pool", "handle"), "mode": "relaxed"}),
        ("capture_end", {}),
    ]


def test_capture_defaults_to_global_on_a_side_stream(fake_npu) -> None:
    backend = NPUBackend()
    graph = backend.create_graph()
    with backend.capture_to_graph(graph):
        assert backend.current_stream() is not fake_npu.default
    (call,) = fake_npu.graph_calls
    assert call["capture_error_mode"] == "global"
    assert call["pool"] is None and call["stream"] is None


def test_capture_rejects_unknown_mode(fake_npu) -> None:
    backend = NPUBackend()
    with pytest.raises(ValueError, match="capture_error_mode must be one of"):
        backend.capture_to_graph(backend.create_graph(), capture_error_mode="strict")


def test_failed_capture_restores_stream_and_explains(fake_npu) -> None:
    backend = NPUBackend()
    graph = backend.create_graph()
    graph.fail_at_capture_end = "error 107025: stream not joined to the original stream"
    with (
        pytest.raises(GraphCaptureError, match="npu_fusion_attention_v3"),
        backend.capture_to_graph(graph),
    ):
        pass
    assert backend.current_stream() is fake_npu.default
    assert not backend.is_current_stream_capturing()


def test_graphcap_errors_inside_capture_pass_through(fake_npu) -> None:
    backend = NPUBackend()
    graph = backend.create_graph()
    with (
        pytest.raises(GraphCaptureError, match=r"^layer 3 appeared$"),
        backend.capture_to_graph(graph),
    ):
        raise GraphCaptureError("layer 3 appeared")
    assert backend.current_stream() is fake_npu.default
    assert graph.events[-1] == ("capture_end", {})


def test_kv_lengths_reach_the_recorded_kernel_through_graph_update(fake_npu) -> None:
    """A call recorded for update (``graph_updates.updatable``, as page attention's is) reads
    the lengths update_graph_kv_lengths gives before each replay (one dict broadcast to it);
    the graph is updatable only because of it, and a replay without an update is refused."""
    backend = NPUBackend()
    graph = backend.create_graph()
    q = torch.randn(2, 2, 1, 16, dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 2, 8, 16, dtype=torch.bfloat16)
    out = {}

    def attend(lengths):
        return fake_torch_npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=2, input_layout="BNSD", scale=0.25, actual_seq_lengths_kv=lengths
        )[0]

    with backend.capture_to_graph(graph, stream=backend.new_stream()):
        attend([8, 8])  # not recorded: captured as a plain operator, frozen
        with graph_updates.updatable():
            out["y"] = attend([8, 8])  # placeholders, as the paged attention records them
    assert graph.dispatch_records == [[8, 8]] and graph.auto_dispatch_capture
    with pytest.raises(RuntimeError, match="update_graph_kv_lengths before every replay"):
        backend.replay_graph(graph)
    for lengths in ([3, 8], [1, 5]):
        backend.update_graph_kv_lengths(graph, lengths)
        backend.replay_graph(graph)
        torch.testing.assert_close(out["y"], attend(lengths), rtol=0, atol=0)
    assert graph.updates[-1] == [{"actual_seq_lengths_kv": [1, 5]}]
    with pytest.raises(RuntimeError, match="update_graph_kv_lengths before every replay"):
        backend.replay_graph(graph)
    plain = backend.create_graph()
    with backend.capture_to_graph(plain, stream=backend.new_stream()):
        attend([8, 8])
    assert plain.dispatch_records == [] and not plain.auto_dispatch_capture
    backend.replay_graph(plain)
    backend.replay_graph(plain)  # nothing waits: no update needed
    synchronized = fake_npu.synchronizations
    backend.update_graph_kv_lengths(plain, [3, 8])  # nothing recorded: no update, no wait
    assert plain.updates == [] and fake_npu.synchronizations == synchronized
    with pytest.raises(RuntimeError, match="auto_dispatch_capture=True"):
        plain.update(cpu_update_input=[{"actual_seq_lengths_kv": [3, 8]}])


def test_replay_replays(fake_npu) -> None:
    backend = NPUBackend()
    graph = backend.create_graph()
    with backend.capture_to_graph(graph):
        pass
    backend.replay_graph(graph)
    backend.replay_graph(graph)
    assert graph.replays == 2


def test_plumbing_goes_to_torch_npu(fake_npu) -> None:
    backend = NPUBackend()
    assert backend.device_module is fake_npu
    assert backend.communication_backend_name() == "hccl"
    assert backend.memory_allocated() == 1234
    assert backend.max_memory_allocated() == 5678
    backend.reset_peak_memory_stats()
    backend.empty_cache()
    assert fake_npu.memory_calls == [
        ("memory_allocated", 0),
        ("max_memory_allocated", 0),
        ("reset_peak_memory_stats", 0),
        ("empty_cache", None),
    ]
    NPUBackend(index=3).memory_allocated()
    assert fake_npu.memory_calls[-1] == ("memory_allocated", 3)
