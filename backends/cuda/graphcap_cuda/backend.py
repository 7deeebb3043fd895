"""CUDA backend: the Backend contract on torch.cuda graphs.

Only availability and the speed hooks are CUDA-specific; the graph hooks (on ``torch.cuda``'s
graph API), streams, synchronize, RNG state and memory figures come from the base classes
(``torch.get_device_module("cuda")`` is ``torch.cuda``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from graphcap.backend import Availability, GraphBackend, MemoryRegion, TruncatedDraw
from graphcap.exact_ops import ExactOps
from graphcap_cuda.attention import DEFAULT_ATTENTION
from graphcap_cuda.kernels import launch
from graphcap_cuda.memory import SleepableRegion, memory_saver

#: Whether compiled regions move a gated MLP's activation and residual adds into the one-row
#: product (graphcap_cuda.kernels.epilogues; benchmarks turn it off).
EPILOGUES = True
#: The BLAS library a compiled capture's matrix products run on (``preferred_blas_library``
#: during its warm-up and capture; replays keep the kernels the capture recorded, and nothing
#: outside it changes; plain captures keep torch's, so they stay bit-equal to eager steps).
#: None: torch's setting. cuBLASLt made the compiled batch-64 step faster and cost nothing
#: elsewhere (docs/decisions.md, decision 18).
CAPTURE_BLAS: str | None = "cublaslt"
#: Whether sampled steps truncate and draw with graphcap_cuda.kernels.sampler's fused kernel
#: (benchmarks turn it off to time the core's PyTorch math).
FUSED_SAMPLER = True

HINT = (
    "Work inside a CUDA graph capture must not synchronise with the host (.item(), "
    "bool(tensor), printing a tensor, nonzero and other data-dependent shapes, copies to "
    "pageable host memory) nor touch CUDA from another thread in 'global' capture mode."
)


class CUDABackend(GraphBackend):
    name: ClassVar[str] = "cuda"
    priority: ClassVar[int] = 100
    device_type: ClassVar[str] = "cuda"
    graph_class: ClassVar[str] = "CUDAGraph"
    capture_hint: ClassVar[str] = HINT
    # torch registers the default CUDA generator with every graph it captures: capture does not
    # advance it and each replay draws fresh numbers from its current state.
    rng_in_graph: ClassVar[bool] = True
    # NCCL collectives can be captured (after one warm-up collective outside the capture).
    collectives_in_graph: ClassVar[bool] = True
    # Capture on the legacy default stream is refused by CUDA.
    capture_needs_side_stream: ClassVar[bool] = True
    # Captured decode steps read grouped-query K/V unrepeated (graphcap_cuda.attention), with
    # the split-KV Triton kernel where Triton is installed (CUDA builds of torch ship it).
    graph_attention: ClassVar[str | None] = DEFAULT_ATTENTION
    # Inductor's kernels are ordinary CUDA launches: a capture records them like any other.
    captures_compiled: ClassVar[bool] = True
    # The compiled step is the fast one, and its compiled code is kept between processes
    # (graphcap.rollout.holder.compile_cache), so default configurations compile; compile=False
    # opts out (docs/decisions.md, decision 39).
    compile_by_default: ClassVar[bool] = True
    # Fused q/k/v and gate/up products made the default step faster at every batch size
    # measured (docs/decisions.md, decision 35); the parameters become views of the fused
    # buffers, so memory does not grow and in-place weight updates reach them.
    fuse_projections_by_default: ClassVar[bool] = True

    @classmethod
    def availability(cls) -> Availability:
        try:
            return _probe()
        except Exception as exc:  # a broken driver must make us unavailable, not crash selection
            return Availability(False, f"probing CUDA raised {type(exc).__name__}: {exc}")

    def register_generator(self, graph: torch.cuda.CUDAGraph, generator: torch.Generator) -> None:
        # Without it, a draw from a user-supplied generator inside the capture raises.
        graph.register_generator_state(generator)

    def compile_options(self) -> dict[str, Any]:
        """Inductor's kernels launch dependent like the plugin's (graphcap_cuda.kernels.launch;
        inductor emits it on Hopper and later only), and independent kernels of a region launch
        as one (combo kernels): each made the compiled step faster (docs/decisions.md,
        decision 17). Where the one-row product runs, a gated MLP's activation and the residual adds
        around it move into its kernel (graphcap_cuda.kernels.epilogues)."""
        options: dict[str, Any] = {"combo_kernels": True}
        if EPILOGUES and self.one_row_product() is not None:
            from graphcap_cuda.kernels import epilogues

            options["post_grad_custom_post_pass"] = epilogues.PASS
        return options | ({"triton.enable_pdl": True} if launch.ENABLED else {})

    def compiled_capture_context(self) -> contextlib.AbstractContextManager[None]:
        """Compiled captures' products on :data:`CAPTURE_BLAS` (cuBLASLt)."""
        return blas_library(CAPTURE_BLAS)

    def memory_region(self) -> MemoryRegion | None:
        """A region on torch_memory_saver (graphcap_cuda.memory) where it is installed and
        torch's expandable segments are off (it maps its own segments); else ``None``, and a
        sleep frees the engine's memory and its graphs."""
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            return None
        saver = memory_saver()
        return None if saver is None else SleepableRegion(saver)

    def one_row_product(self) -> Callable[..., torch.Tensor] | None:
        """graphcap_cuda.kernels.gemv's one-row kernel where Triton is installed."""
        try:
            from graphcap_cuda.kernels import gemv
        except ImportError:  # a torch build without Triton
            return None
        return gemv.linear

    def truncated_draw(self) -> TruncatedDraw | None:
        """graphcap_cuda.kernels.sampler's kernel where Triton is installed: one kernel
        truncates and draws, with no sort of the vocabulary."""
        if not FUSED_SAMPLER:
            return None
        try:
            from graphcap_cuda.kernels import sampler
        except ImportError:  # a torch build without Triton
            return None
        return sampler.truncated_draw

    def exact_ops(self) -> ExactOps | None:
        """graphcap_cuda.kernels.exact's Triton kernels where Triton is installed: products,
        attention and row reductions whose order follows neither the number of rows nor the
        padding (docs/decisions.md, decision 90)."""
        try:
            from graphcap_cuda.kernels import exact
        except ImportError:  # a torch build without Triton
            return None
        return exact.OPS


@contextlib.contextmanager
def blas_library(library: str | None) -> Iterator[None]:
    """Within the block, torch's preferred BLAS library is ``library`` (restored after); a
    torch build that cannot use it keeps its own."""
    before = torch.backends.cuda.preferred_blas_library()
    try:
        if library is not None:
            torch.backends.cuda.preferred_blas_library(library)
    except RuntimeError:  # e.g. a build without cuBLASLt
        pass
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _probe() -> Availability:
    if not torch.backends.cuda.is_built():
        return Availability(
            False,
            f"torch {torch.__version__} is a build without CUDA; install a CUDA build of torch",
        )
    count = torch.cuda.device_count()
    if count == 0 or not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return Availability(
            False, f"torch {torch.__version__} has CUDA support but sees no CUDA device{where}"
        )
    runtime = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"HIP {torch.version.hip}"
    return Availability(
        True, f"{count} CUDA device(s) visible (torch {torch.__version__}, {runtime})"
    )
