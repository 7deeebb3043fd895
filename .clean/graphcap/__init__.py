"""graphcap: graph-captured LLM rollouts on any accelerator.

The core defines the Backend contract and selects a backend; ``graphcap.rollout`` runs Hugging
Face decoder models with the whole decode step captured as a device graph.
"""

from importlib import metadata

from graphcap.backend import Availability, Backend, Capabilities, GraphBackend
from graphcap.errors import (
    BackendSelectionError,
    GraphcapError,
    GraphCaptureError,
    GraphUnsupportedError,
)
from graphcap.hookspecs import PLUGIN_API_VERSION, hookimpl
from graphcap.registry import discover, get_backend

try:  # the installed distribution's version (pyproject.toml is the one place it is written)
    __version__ = metadata.version("graphcap")
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "unknown"

__all__ = [
    "PLUGIN_API_VERSION",
    "Availability",
    "Backend",
    "BackendSelectionError",
    "Capabilities",
    "GraphBackend",
    "GraphCaptureError",
    "GraphUnsupportedError",
    "GraphcapError",
    "discover",
    "get_backend",
    "hookimpl",
]
