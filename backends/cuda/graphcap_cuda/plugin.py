"""The module named by the ``graphcap`` entry point: pluggy hook implementations."""

from __future__ import annotations

from graphcap.backend import Backend
from graphcap.hookspecs import PLUGIN_API_VERSION, hookimpl
from graphcap_cuda.backend import CUDABackend


@hookimpl
def graphcap_api_version() -> int:
    return PLUGIN_API_VERSION


@hookimpl
def graphcap_backends() -> list[type[Backend]]:
    return [CUDABackend]
