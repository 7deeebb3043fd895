"""The module named by the ``graphcap`` entry point: pluggy hook implementations."""

from __future__ import annotations

from collections.abc import Callable

from graphcap.backend import Backend
from graphcap.hookspecs import PLUGIN_API_VERSION, hookimpl
from graphcap_cuda.attention import IMPLEMENTATIONS
from graphcap_cuda.backend import CUDABackend


@hookimpl
def graphcap_api_version() -> int:
    return PLUGIN_API_VERSION


@hookimpl
def graphcap_backends() -> list[type[Backend]]:
    return [CUDABackend]


@hookimpl
def graphcap_attention_implementations(backend: Backend) -> dict[str, Callable[..., object]]:
    """The grouped-query attentions (``IMPLEMENTATIONS``), offered only when the selected
    backend is ours (pluggy calls every plugin's implementation). graphcap registers
    transformers' SDPA mask function with each."""
    if not isinstance(backend, CUDABackend):
        return {}
    return dict(IMPLEMENTATIONS)
