"""graphcap-cuda: safe to install and import anywhere; the real graph hooks where CUDA exists.

The full Backend contract on a GPU is checked by the conformance suite
(``GRAPHCAP_BACKEND=cuda python -m graphcap.testing``); these tests cover what is specific to
this plugin.
"""

from __future__ import annotations

import contextlib
from importlib import metadata

import pytest
import torch
import torch._inductor.config  # private: the option names compile_options() must match
from graphcap_cuda import CUDABackend
from graphcap_cuda.kernels import launch

import graphcap
from graphcap.errors import BackendSelectionError, GraphCaptureError
from graphcap.registry import discover

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def test_entry_point_is_installed() -> None:
    entry_points = metadata.entry_points(group="graphcap", name="cuda")
    assert [ep.value for ep in entry_points] == ["graphcap_cuda.plugin"], (
        "install the plugin first: pip install -e backends/cuda --no-deps"
    )


def test_registry_discovers_the_backend() -> None:
    registry = discover(refresh=True)
    record = registry.backends["cuda"]
    assert record.cls is CUDABackend
    assert record.distribution == "graphcap-cuda"
    assert record.version == metadata.version("graphcap-cuda")
    assert not [f for f in registry.failures if f.entry_point == "cuda"]


def test_compile_options_are_inductor_settings(monkeypatch) -> None:
    """The options compiled regions get are settings this torch's inductor knows (torch.compile
    refuses others), with dependent launches only while graphcap_cuda's kernels use them."""
    known = torch._inductor.config.get_config_copy()  # private: inductor lists options nowhere else
    options = CUDABackend().compile_options()
    assert options and all(name in known for name in options)
    assert options["triton.enable_pdl"] is True
    monkeypatch.setattr(launch, "ENABLED", False)
    assert "triton.enable_pdl" not in CUDABackend().compile_options()


def test_dependent_launch_only_on_a_gpu(monkeypatch) -> None:
    """Kernels launch dependent on Hopper or later GPUs only, never under the interpreter."""
    assert not launch.dependent(torch.device("cpu"))
    if torch.cuda.is_available():
        monkeypatch.setattr(launch, "ENABLED", False)
        assert not launch.dependent(torch.device("cuda"))


def test_kernels_compile_with_inductors_ptxas(monkeypatch) -> None:
    """The plugin's kernel modules set Triton's ptxas through inductor's own setter before
    their first compile, so a process that compiled from scratch and one that loaded compiled
    code key Triton's cache alike (the H200 triage found 13 kernels compiled again otherwise).
    The setter is torch's private: this fails when a torch release moves it."""
    from torch._inductor.runtime import compile_tasks  # private: the setter under test

    calls = []
    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", lambda: calls.append(1))
    launch.use_inductors_ptxas.cache_clear()
    launch.use_inductors_ptxas()
    launch.use_inductors_ptxas()
    launch.use_inductors_ptxas.cache_clear()
    assert calls == [1]


def test_the_default_joins_projections_and_compiles() -> None:
    """CUDA declares both speed defaults (measured in docs/benchmarks.md): joined q/k/v and
    gate/up products and compiled captured steps."""
    assert CUDABackend.fuse_projections_by_default and CUDABackend.compile_by_default


def test_selected_before_the_cpu_backend() -> None:
    registry = discover(refresh=True)
    assert registry.backends["cuda"].cls.priority > registry.backends["cpu"].cls.priority


@pytest.mark.device
@needs_cuda
def test_declared_capabilities_match_the_gpu() -> None:
    """Each declaration, tried: graphs exist, capture on the legacy default stream is refused
    (so the side stream is needed), and replays draw fresh numbers from the default generator.
    Collectives in graphs are checked by the conformance suite (one-rank NCCL group)."""
    backend = CUDABackend()
    capabilities = backend.capabilities
    assert CUDABackend.graph_capture is capabilities.graph_capture is True
    assert capabilities.capture_needs_side_stream
    assert capabilities.rng_in_graph
    noise = torch.zeros(4, device="cuda")
    side = backend.capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        noise.copy_(torch.rand(4, device="cuda"))
    torch.cuda.current_stream().wait_stream(side)
    graph = backend.create_graph()
    with backend.capture_to_graph(graph, stream=side):
        noise.copy_(torch.rand(4, device="cuda"))
    draws = []
    for _ in range(3):
        backend.replay_graph(graph)
        draws.append(noise.tolist())
    assert draws[0] != draws[1] != draws[2], "replays drew the same numbers: RNG frozen"
    x = torch.ones(4, device="cuda")  # last: a refused capture can leave the generator unusable
    with (
        pytest.raises(GraphCaptureError),
        backend.capture_to_graph(backend.create_graph(), stream=torch.cuda.default_stream()),
    ):
        x.add_(1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_unavailable_without_cuda_says_why() -> None:
    availability = CUDABackend.availability()
    assert not availability.ok
    assert "CUDA" in availability.reason
    with pytest.raises(BackendSelectionError, match="unavailable here"):
        graphcap.get_backend("cuda")


def test_no_visible_device_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    availability = CUDABackend.availability()
    assert not availability.ok
    assert "sees no CUDA device" in availability.reason
    assert "CUDA_VISIBLE_DEVICES=''" in availability.reason


def test_availability_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> int:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", broken)
    availability = CUDABackend.availability()
    assert not availability.ok
    assert "RuntimeError: driver exploded" in availability.reason


def test_bad_capture_error_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="capture_error_mode must be one of"):
        CUDABackend().capture_to_graph(None, capture_error_mode="strict")


@pytest.mark.device
@needs_cuda
def test_auto_selected_when_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHCAP_BACKEND", raising=False)
    backend = graphcap.get_backend()
    assert isinstance(backend, CUDABackend)
    assert backend.device.type == "cuda"


@pytest.mark.device
@needs_cuda
def test_capture_and_replay_on_the_gpu() -> None:
    backend = CUDABackend()
    x = torch.ones(8, device="cuda")
    total = torch.zeros(8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        total.add_(x)
    torch.cuda.current_stream().wait_stream(side)
    total.zero_()
    graph = backend.create_graph()
    with backend.capture_to_graph(graph, pool=backend.graph_pool_handle()):
        assert backend.is_current_stream_capturing()
        assert torch.cuda.current_stream() != torch.cuda.default_stream()
        total.add_(x)
    torch.cuda.synchronize()
    assert total.sum().item() == 0.0  # recorded, not run
    for _ in range(3):
        backend.replay_graph(graph)
    torch.cuda.synchronize()
    assert total.tolist() == [3.0] * 8


@pytest.mark.device
@needs_cuda
def test_failed_capture_restores_the_stream_and_says_why() -> None:
    backend = CUDABackend()
    x = torch.ones(4, device="cuda")
    (x * 2).sum().item()
    before = torch.cuda.current_stream()
    with (
        pytest.raises(GraphCaptureError, match="must not synchronise with the host"),
        backend.capture_to_graph(backend.create_graph()),
    ):
        (x * 2).sum().item()
    assert torch.cuda.current_stream() == before
    assert not backend.is_current_stream_capturing()
    assert (x + 1).sum().item() == 8.0


def test_compiled_captures_choose_their_blas_library_and_restore_torchs(monkeypatch) -> None:
    """A compiled capture's products run on CAPTURE_BLAS; torch's setting is back after it
    (also when the capture fails), and a build that cannot use the library keeps its own."""
    from graphcap_cuda import backend as cuda_backend

    chosen = ["cublas"]

    def preferred(library=None):
        if library == "missing":
            raise RuntimeError("Cannot set preferred backend")
        if library is not None:
            chosen[0] = library
        return chosen[0]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    seen = []
    with CUDABackend().compiled_capture_context():
        seen.append(chosen[0])
    with pytest.raises(ValueError), cuda_backend.blas_library("cublaslt"):
        seen.append(chosen[0])
        raise ValueError("capture failed")
    for library in ("missing", None):
        with cuda_backend.blas_library(library):
            seen.append(chosen[0])
    assert seen == ["cublaslt", "cublaslt", "cublas", "cublas"] and chosen == ["cublas"]
    assert cuda_backend.CAPTURE_BLAS == "cublaslt"


@needs_cuda
def test_only_compiled_captures_run_on_cublaslt() -> None:
    backend, before = CUDABackend(), torch.backends.cuda.preferred_blas_library()
    # Drawn on the CPU: a test before this one may leave the CUDA generator unusable on purpose.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 256, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(256, 128, generator=gen).to("cuda", torch.bfloat16)
    out = a @ b
    side = backend.capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with backend.capture_to_graph(backend.create_graph(), stream=side):
        plain = torch.backends.cuda.preferred_blas_library()
    graph = backend.create_graph()
    with backend.compiled_capture_context(), backend.capture_to_graph(graph, stream=side):
        compiled = torch.backends.cuda.preferred_blas_library()
        out.copy_(a @ b)
    backend.replay_graph(graph)
    torch.cuda.synchronize()
    assert plain == before and str(compiled).lower().endswith("cublaslt")
    assert torch.backends.cuda.preferred_blas_library() == before
    torch.testing.assert_close(out, (a.float() @ b.float()).to(out.dtype), rtol=2e-2, atol=2e-2)


def test_memory_regions_only_with_torch_memory_saver_and_without_expandable_segments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The region comes from torch_memory_saver (the optional ``sleep`` extra): without it, or
    with torch's expandable segments (which map their own segments), the backend offers none,
    and engines free their memory at a sleep."""
    from graphcap_cuda import memory

    installed = memory.memory_saver() is not None
    backend = CUDABackend(0)
    if installed and torch.cuda.is_available():
        assert backend.memory_region() is not None
    else:
        assert backend.memory_region() is None
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert backend.memory_region() is None


def test_a_capture_in_a_region_registers_the_default_generator_outside_it_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default generator's graph-safe state is the process's: torch makes it when the
    first graph registers the generator (a capture's start) and frees it with the last. A
    capture in an engine's region registers it first with a graph the process keeps, before
    the region opens, so no engine's sleep unmaps it under another's graphs (an illegal memory
    access on an H100). Played here with torch_memory_saver's and CUDA's parts recorded."""
    from graphcap_cuda import memory

    events: list[str] = []

    class Saver:
        def region(self, tag: str, enable_cpu_backup: bool):
            events.append("region opens")
            return contextlib.nullcontext()

        def pause(self, tag: str) -> None: ...

    class Graph:
        def register_generator_state(self, generator: object) -> None:
            events.append(f"registered {generator}")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "default_generators", ("generator 0",))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *args: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    memory.generator_state_outside_regions.cache_clear()
    try:
        region = memory.SleepableRegion(Saver())
        for _ in range(2):
            with region.capturing():
                events.append("capture")
        region.close()  # here, not in a finaliser after the CUDA stand-ins are gone
        assert events == ["registered generator 0", *["region opens", "capture"] * 2]
        assert isinstance(memory.generator_state_outside_regions(0), Graph)  # kept
    finally:
        memory.generator_state_outside_regions.cache_clear()
