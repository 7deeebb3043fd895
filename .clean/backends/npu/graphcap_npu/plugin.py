"""The module named by the ``graphcap`` entry point: pluggy hook implementations.

Importing it imports torch and graphcap only, never torch_npu, so it is safe on any machine.
"""

from __future__ import annotations

from collections.abc import Callable

from graphcap.backend import Backend
from graphcap.hookspecs import PLUGIN_API_VERSION, hookimpl
from graphcap_npu.attention import BLOCKS, FA3_BNSD, FA3_BSH, FORWARDS
from graphcap_npu.backend import NPUBackend


@hookimpl
def graphcap_api_version() -> int:
    return PLUGIN_API_VERSION


@hookimpl
def graphcap_backends() -> list[type[Backend]]:
    return [NPUBackend]


@hookimpl
def graphcap_attention_implementations(backend: Backend) -> dict[str, Callable[..., object]]:
    """The fused attention, offered only when the selected backend is ours.

    Both layouts of ``npu_fusion_attention_v3`` and the paged attention (they run every dtype
    the conformance models use), plus the backend's own ``graph_attention`` when it chose
    another implementation (``npu_fused_infer_attention_score``, half precision only, which the
    half-precision conformance checks cover). pluggy calls every plugin's
    implementation, so other backends get nothing from here. The engine registers each name with
    transformers' ``sdpa_mask`` (this backend's ``mask_form`` is "bool").
    """
    if not isinstance(backend, NPUBackend):
        return {}
    names = dict.fromkeys((BLOCKS, FA3_BSH, FA3_BNSD, backend.graph_attention))
    return {name: FORWARDS[name] for name in names if name is not None}
