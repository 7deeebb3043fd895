"""Ascend NPU backend: the Backend contract on torch_npu's ACL graphs.

``torch.npu`` exists only after ``import torch_npu``, and that import may kill the process on a
machine without CANN. So nothing here imports torch_npu until :func:`npu_availability` has
probed it in a child process; every device call goes through :func:`npu_module`, which refuses
with the probe's reason instead of failing somewhere deep inside torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from graphcap.backend import Availability, GraphBackend, MaskForm
from graphcap.errors import BackendSelectionError, GraphCaptureError
from graphcap_npu import generators, graph_updates
from graphcap_npu.attention import BLOCKS, IMPLEMENTATIONS
from graphcap_npu.probe import (
    INSTALL_HINT,
    VISIBLE_DEVICES_VAR,
    probe_torch_npu,
    torch_npu_installed,
    version_problem,
)

#: Environment variable naming the attention captured decode steps run on this backend.
ATTENTION_VAR = "GRAPHCAP_NPU_ATTENTION"
#: torch_npu's task-queue setting, read once per process; NPUGraph refuses every
#: capture under its value 2.
TASK_QUEUE_VAR = "TASK_QUEUE_ENABLE"

HINT = (
    "Work inside an ACL graph capture must not synchronise with the host (.item(), printing a "
    "tensor, data-dependent shapes), seed a generator, or use operators that run on an internal "
    "secondary stream (error 107025: npu_fusion_attention v1/v2 do; use "
    "npu_fusion_attention_v3, graphcap_npu.fusion_attention_forward). Only aclnn operators can "
    "be captured."
)


@functools.cache
def npu_availability() -> Availability:
    """Whether torch_npu runs here and sees a device; probed once per process, then cached.

    Unless torch_npu is already imported, a child-process probe comes first, and torch_npu is
    imported here only when the child succeeded.
    """
    reason = ""
    if "torch_npu" not in sys.modules:
        if not torch_npu_installed():
            return Availability(False, f"torch_npu is not installed; {INSTALL_HINT}")
        probe = probe_torch_npu()
        if not probe.ok:
            return Availability(False, probe.reason)
        reason = probe.reason
        try:
            importlib.import_module("torch_npu")
        except BaseException as exc:  # exit() inside the import must not end this process
            if isinstance(exc, KeyboardInterrupt):
                raise
            return Availability(
                False,
                f"torch_npu imported in a probe process but not here: {type(exc).__name__}: {exc}",
            )
    too_old = version_problem(str(getattr(sys.modules["torch_npu"], "__version__", "unknown")))
    if too_old is not None:
        return Availability(False, too_old)
    npu = getattr(torch, "npu", None)
    if npu is None:
        return Availability(False, "torch_npu was imported but did not create torch.npu")
    count = int(npu.device_count()) if npu.is_available() else 0
    if count < 1:
        visible = os.environ.get(VISIBLE_DEVICES_VAR)
        where = f"={visible!r}" if visible is not None else " is unset"
        return Availability(
            False,
            f"torch_npu is imported but torch.npu sees no device ({VISIBLE_DEVICES_VAR}{where});"
            " check the driver (npu-smi info)",
        )
    return Availability(True, reason or f"{count} NPU device(s) visible (torch_npu imported)")


def npu_module() -> Any:
    """``torch.npu``, importing torch_npu first if needed; refuses when the backend cannot run."""
    if "torch_npu" not in sys.modules or getattr(torch, "npu", None) is None:
        availability = npu_availability()
        if not availability.ok:
            raise BackendSelectionError(f"the npu backend cannot run here: {availability.reason}")
    return torch.npu


class NPUBackend(GraphBackend):
    name: ClassVar[str] = "npu"
    # Same tier as cuda: an accelerator is preferred over the CPU reference backend.
    priority: ClassVar[int] = 100
    device_type: ClassVar[str] = "npu"
    graph_class: ClassVar[str] = "NPUGraph"
    capture_hint: ClassVar[str] = HINT
    # torch_npu keeps graph-safe generator state (NPUGraph registers the default generator at
    # capture_begin; register_generator registers an explicit one), so sampling can live
    # inside the graph. Declared from torch_npu's source; the conformance suite checks it on
    # hardware.
    rng_in_graph: ClassVar[bool] = True
    # HCCL collectives inside an ACL graph are not relied upon: tensor-parallel steps run eagerly.
    collectives_in_graph: ClassVar[bool] = False
    # ACL graphs cannot be captured on the default stream.
    capture_needs_side_stream: ClassVar[bool] = True
    # npu_fusion_attention_v3 takes a boolean mask; a float mask sends torch_npu's SDPA to a slow
    # unfused path.
    mask_form: ClassVar[MaskForm] = "bool"
    # Page attention over the block table (npu_fused_infer_attention_score, BNSD query, no cache
    # copy), v3 in BNSD where it does not apply (graphcap_npu.attention); an instance may
    # choose another (``attention=`` or GRAPHCAP_NPU_ATTENTION).
    graph_attention: ClassVar[str | None] = BLOCKS
    # Blocks of 128 columns: the page-attention block size torch_npu recommends (fp16/bf16 take
    # any multiple of 16).
    kv_block_size: ClassVar[int | None] = 128
    # npu_fused_infer_attention_score takes actual_seq_lengths_kv as host ints; page attention's
    # call is captured under the graph's dispatch mode (graph_updates), so NPUGraph.update can
    # set them before a replay. No capture runs whole under it (auto_dispatch_capture stays
    # off): every other call torch_npu records would wait at each replay for an update.
    graph_kv_lengths_on_host: ClassVar[bool] = True

    def __init__(self, index: int | None = None, attention: str | None = None) -> None:
        """``attention``: the graphcap_npu implementation captured decode steps run (one of
        :data:`graphcap_npu.attention.IMPLEMENTATIONS`); default: the ``GRAPHCAP_NPU_ATTENTION``
        environment variable, else ``graphcap_npu_blocks``."""
        super().__init__(index)
        choice = attention or os.environ.get(ATTENTION_VAR) or BLOCKS
        if choice not in IMPLEMENTATIONS:
            where = "attention" if attention else ATTENTION_VAR
            raise ValueError(
                f"{where}={choice!r} is not a graphcap_npu attention; choose one of "
                f"{', '.join(IMPLEMENTATIONS)}"
            )
        self.graph_attention = choice  # type: ignore[misc]  # per instance, over the class default

    @classmethod
    def availability(cls) -> Availability:
        try:
            return npu_availability()
        except Exception as exc:  # a broken install must make us unavailable, not crash selection
            return Availability(False, f"probing torch_npu raised {type(exc).__name__}: {exc}")

    # ---- graph hooks (the rest come from GraphBackend, on torch.npu) ----------------------
    def is_current_stream_capturing(self) -> bool:
        if "torch_npu" not in sys.modules:
            return False  # torch_npu never loaded in this process: nothing can be capturing
        return super().is_current_stream_capturing()

    def capture_to_graph(
        self,
        graph: Any,
        pool: Any | None = None,
        stream: Any | None = None,
        capture_error_mode: str | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """The base capture (``auto_dispatch_capture`` off), refused up front under
        ``TASK_QUEUE_ENABLE=2`` (NPUGraph's ``capture_begin`` refuses it); page attention's
        calls inside record themselves for update (:mod:`graphcap_npu.graph_updates`)."""
        if os.environ.get(TASK_QUEUE_VAR, "").strip() == "2":
            raise GraphCaptureError(
                f"{TASK_QUEUE_VAR}=2 makes every torch_npu graph capture fail; start the process "
                f"with {TASK_QUEUE_VAR}=1 (or 0) to capture, or run eagerly"
            )
        capture = super().capture_to_graph(graph, pool, stream, capture_error_mode)
        return self._recovering(graph, _recording(graph, capture))

    @contextlib.contextmanager
    def _recovering(
        self, graph: Any, capture: contextlib.AbstractContextManager[None]
    ) -> Iterator[None]:
        """``capture``; when it fails, the generators it knew are made usable again
        (:func:`graphcap_npu.generators.recover`), before the error goes on."""
        try:
            with capture:
                yield
        except Exception as exc:
            if generators.per_capture_state():
                raise
            try:
                generators.recover(self.device_module, graph, self.device)
            except GraphCaptureError as restart:
                raise restart from exc
            raise

    def register_generator(self, graph: Any, generator: torch.Generator) -> None:
        # Before torch_npu 2.12.0.post3 NPUGraph knows only the default generator itself; a
        # draw from any other inside the capture raises ("... NPU generator not in capture
        # mode"). From it, registering is a deprecated no-op (graphcap_npu.generators).
        generators.register(graph, generator)

    def update_graph_kv_lengths(self, graph: Any, lengths: list[int]) -> None:
        """One update for every page-attention call recorded in ``graph`` (torch_npu broadcasts
        a one-item list over the graph's dispatch records); nothing for a graph without any
        (a step page attention did not serve: fp32, off the block table), which waits for no
        update.

        torch_npu runs the update on a stream of its own, which nothing orders after the replay
        queued before it: an update could rewrite the lengths that replay still has to read.
        So the device finishes its queued work first, as vllm-ascend does before each of its
        full-graph replays."""
        if not graph_updates.is_updatable(graph):
            return
        self.synchronize()
        graph.update(cpu_update_input=[{"actual_seq_lengths_kv": list(lengths)}])
        graph_updates.updated(graph)

    def replay_graph(self, graph: Any) -> None:
        """The replay, refused (not hung) when the graph waits for an update nothing issued."""
        graph_updates.check_replay(graph)
        graph.replay()

    def memory_region(self) -> None:
        """None: no region keeps addresses across a release here, so a sleep frees the
        engine's buffers and graphs and the next call captures again (``recapture_reason``
        ``["woke from sleep"]``).

        torch_npu has no such API of its own: unmapping memory while keeping its addresses
        takes ACL's virtual-memory calls inside an allocator compiled against CANN and
        plugged in through ``NPUPluggableAllocator``, and graphcap ships no compiled code.
        The one such allocator on Ascend machines, vllm-ascend's CaMem, is a process-wide
        singleton whose ``sleep`` releases every allocation in it, and before torch_npu
        2.13.0 a pool's allocator is not the one that frees its blocks, so graphs' memory
        cannot live there (docs/npu.md, "Sleep and memory regions")."""
        return None

    # ---- device plumbing ------------------------------------------------------------------
    @property
    def device_module(self) -> Any:
        # The base class asks torch.get_device_module("npu"), which fails until torch_npu has
        # been imported (it registers the "npu" device type).
        return npu_module()

    # torch.accelerator's memory figures need the device to register a c10 DeviceAllocator;
    # torch.npu's own memory functions exist in every torch_npu release.
    def memory_allocated(self) -> int | None:
        return int(self.device_module.memory_allocated(self._device_index()))

    def max_memory_allocated(self) -> int | None:
        return int(self.device_module.max_memory_allocated(self._device_index()))

    def reset_peak_memory_stats(self) -> None:
        self.device_module.reset_peak_memory_stats(self._device_index())

    def empty_cache(self) -> None:
        self.device_module.empty_cache()

    def communication_backend_name(self) -> str:
        # torch.distributed learns "npu -> hccl" only once torch_npu is imported.
        return "hccl"

    def _device_index(self) -> int:
        return self._index if self._index is not None else self.current_device_index()


@contextlib.contextmanager
def _recording(graph: Any, capture: contextlib.AbstractContextManager[None]) -> Iterator[None]:
    """``capture``, with ``graph`` known to the calls that record themselves for update; it is
    marked updatable only after torch_npu's ``graph.__exit__`` ran (which pops the dispatch
    mode of a graph that is marked by then)."""
    with graph_updates.capturing(graph), capture:
        yield
