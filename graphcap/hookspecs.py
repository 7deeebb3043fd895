"""pluggy hook specifications: how a plugin distribution offers backends to graphcap.

A plugin is a module named by an entry point in the group ``graphcap``. It implements
``graphcap_api_version`` (so the core can refuse a plugin written for another contract) and
``graphcap_backends``; it may implement ``graphcap_attention_implementations``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from graphcap.backend import Backend

PROJECT_NAME = "graphcap"
ENTRY_POINT_GROUP = "graphcap"
#: The contract version this core speaks. Bump it when the Backend contract changes
#: incompatibly; list older versions in SUPPORTED_API_VERSIONS while they still work.
#: Version 2 declares each capability under its ``Capabilities`` name; version 1's names
#: (``graphcap.backend.OLD_CAPABILITY_NAMES``) still work, with a DeprecationWarning.
PLUGIN_API_VERSION = 2
SUPPORTED_API_VERSIONS: tuple[int, ...] = (1, 2)

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def graphcap_api_version() -> int:
    """The plugin API version this plugin was written for (``graphcap.PLUGIN_API_VERSION``)."""


@hookspec
def graphcap_backends() -> Sequence[type[Backend]]:
    """Backend classes this plugin provides."""


@hookspec
def graphcap_attention_implementations(backend: Backend) -> dict[str, Callable[..., object]]:
    """Attention functions (name -> callable) to register with transformers for ``backend``.

    Called only for the selected backend. The callables follow transformers'
    ``AttentionInterface`` signature; graphcap registers them and their mask function.
    """
