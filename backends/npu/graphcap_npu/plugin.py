"""The module named by the ``graphcap`` entry point: pluggy hook implementations.

Importing it imports torch and graphcap only, never torch_npu, so it is safe on any machine.
"""

from __future__ import annotations

from collections.abc import Callable

from graphcap.backend import Backend
from graphcap.hookspecs import PLUGIN_API_VERSION, hookimpl
from graphcap_npu.attention import ATTENTION_NAME, fusion_attention_forward
from graphcap_npu.backend import NPUBackend


@hookimpl
def graphcap_api_version() -> int:
    return PLUGIN_API_VERSION


@hookimpl
def graphcap_backends() -> list[type[Backend]]:
    return [NPUBackend]


@hookimpl
def graphcap_attention_implementations(backend: Backend) -> dict[str, Callable[..., object]]:
    """The fused graph-mode attention, offered only when the selected backend is ours.

    pluggy calls every plugin's implementation, so other backends get nothing from here. Its
    mask function must be registered too (transformers passes no mask otherwise): it takes
    masks in this backend's ``mask_form`` ("bool", transformers' ``sdpa_mask``);
    :func:`graphcap_npu.attention.register_attention` does both.
    """
    if not isinstance(backend, NPUBackend):
        return {}
    return {ATTENTION_NAME: fusion_attention_forward}
