"""Plugin discovery and backend selection.

Plugins are found through the entry-point group ``graphcap``. Each entry point is loaded inside
its own guard and then registered with pluggy (pluggy's bulk loader would abort on the first
broken plugin), so one broken plugin is reported and skipped instead of breaking the others.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy
import torch

from graphcap import hookspecs
from graphcap.backend import Availability, Backend
from graphcap.cpu.backend import CPUPlugin
from graphcap.errors import BackendSelectionError

logger = logging.getLogger("graphcap")

ENV_VAR = "GRAPHCAP_BACKEND"

#: Where to get a plugin for a device torch can see; used when none is installed.
PLUGIN_HINTS: dict[str, str] = {
    "cuda": "graphcap-cuda (from a graphcap source checkout: pip install ./backends/cuda)",
    "npu": "graphcap-npu (from a graphcap source checkout: pip install ./backends/npu)",
}


@dataclass
class BackendRecord:
    """One backend class offered by one plugin, with where it came from."""

    name: str
    cls: type[Backend]
    distribution: str
    version: str

    def availability(self) -> Availability:
        try:
            return self.cls.availability()
        except Exception as exc:  # a backend's probe must not take selection down with it
            return Availability(False, f"availability check raised {type(exc).__name__}: {exc}")


@dataclass
class PluginFailure:
    """A plugin that could not be used: it failed to import, or speaks another API version."""

    entry_point: str
    distribution: str
    error: str


@dataclass
class Registry:
    plugin_manager: pluggy.PluginManager
    backends: dict[str, BackendRecord] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    #: One backend object per name, shared by every caller (its capture stream included).
    instances: dict[str, Backend] = field(default_factory=dict)

    def failure_for(self, name: str) -> PluginFailure | None:
        return next((f for f in self.failures if f.entry_point == name), None)

    def describe(self) -> str:
        """One line per installed backend and per broken plugin: what is there and why."""
        lines = []
        for record in sorted(self.backends.values(), key=lambda r: -r.cls.priority):
            avail = record.availability()
            state = "available" if avail.ok else "unavailable"
            lines.append(f"  - {record.name} ({record.distribution}): {state}: {avail.reason}")
        for failure in self.failures:
            lines.append(
                f"  - {failure.entry_point} ({failure.distribution}): broken plugin: "
                f"{failure.error}"
            )
        return "\n".join(lines)


def _distribution_of(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown", ""
    return dist.metadata["Name"] or "unknown", dist.version or ""


def _check_api_version(plugin: Any) -> str | None:
    """Why this plugin cannot be used with this core's contract, or None if it can."""
    version_hook = getattr(plugin, "graphcap_api_version", None)
    if version_hook is None:
        return (
            "it does not implement graphcap_api_version(); it was written for an unknown "
            f"plugin API (this graphcap speaks version {hookspecs.PLUGIN_API_VERSION})"
        )
    version = version_hook()
    if version not in hookspecs.SUPPORTED_API_VERSIONS:
        supported = ", ".join(str(v) for v in hookspecs.SUPPORTED_API_VERSIONS)
        return (
            f"it was written for graphcap plugin API version {version}, but this graphcap "
            f"supports version(s) {supported}; install a release of the plugin made for API "
            f"{hookspecs.PLUGIN_API_VERSION}, or a graphcap release that supports API {version}"
        )
    return None


def _register(
    registry: Registry, plugin: Any, ep_name: str, distribution: str, version: str
) -> None:
    refusal = _check_api_version(plugin)
    if refusal is not None:
        registry.failures.append(PluginFailure(ep_name, distribution, refusal))
        warnings.warn(
            f"graphcap plugin {ep_name!r} from {distribution} refused: {refusal}", stacklevel=3
        )
        return
    registry.plugin_manager.register(plugin, name=ep_name)
    # Ask this plugin alone (not the whole hook) so each backend is tied to its distribution.
    for cls in plugin.graphcap_backends() or []:
        if cls.name in registry.backends:
            other = registry.backends[cls.name].distribution
            message = (
                f"backend name {cls.name!r} is offered by both {other} and {distribution}; "
                f"keeping the one from {other}. Uninstall one of them."
            )
            registry.failures.append(PluginFailure(ep_name, distribution, message))
            warnings.warn(message, stacklevel=3)
            continue
        registry.backends[cls.name] = BackendRecord(cls.name, cls, distribution, version)


def _load_entry_points(registry: Registry, entry_points: Iterable[metadata.EntryPoint]) -> None:
    for ep in entry_points:
        distribution, version = _distribution_of(ep)
        try:
            plugin = ep.load()
        except BaseException as exc:  # a plugin may even call exit() on import
            if isinstance(exc, KeyboardInterrupt):
                raise
            error = f"import of {ep.value!r} raised {type(exc).__name__}: {exc}"
            registry.failures.append(PluginFailure(ep.name, distribution, error))
            warnings.warn(
                f"graphcap plugin {ep.name!r} from {distribution} is broken and was skipped: "
                f"{error}",
                stacklevel=2,
            )
            continue
        try:
            _register(registry, plugin, ep.name, distribution, version)
        except Exception as exc:
            error = f"its hooks raised {type(exc).__name__}: {exc}"
            registry.failures.append(PluginFailure(ep.name, distribution, error))
            warnings.warn(
                f"graphcap plugin {ep.name!r} from {distribution} is broken and was skipped: "
                f"{error}",
                stacklevel=2,
            )


_registry: Registry | None = None


def discover(refresh: bool = False) -> Registry:
    """The registry of installed backends (built-in CPU plus entry-point plugins), cached."""
    global _registry
    if _registry is not None and not refresh:
        return _registry
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    registry = Registry(pm)
    _register(registry, CPUPlugin(), "cpu", "graphcap", _own_version())
    _load_entry_points(registry, metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP))
    _registry = registry
    return registry


def _own_version() -> str:
    try:
        return metadata.version("graphcap")
    except metadata.PackageNotFoundError:
        return "unknown"


def visible_accelerator() -> str | None:
    """The accelerator type torch itself can see here (e.g. "cuda"), or None."""
    device = torch.accelerator.current_accelerator(check_available=True)
    return None if device is None else device.type


def unclaimed_accelerator(registry: Registry) -> str | None:
    """A sentence when torch sees an accelerator that no installed backend claims, else None."""
    device_type = visible_accelerator()
    if device_type is None:
        return None
    if any(r.cls.device_type == device_type for r in registry.backends.values()):
        return None
    hint = PLUGIN_HINTS.get(device_type, f"a graphcap plugin for {device_type!r}")
    return (
        f"torch sees a {device_type!r} accelerator, but no installed graphcap backend claims it. "
        f"Install {hint}, or set {ENV_VAR}=cpu to run on the CPU deliberately."
    )


def _select_name(registry: Registry, requested: str | None) -> str:
    if requested:
        return requested
    available = [r for r in registry.backends.values() if r.availability().ok]
    best = max(available, key=lambda r: r.cls.priority)
    if best.cls.device_type == "cpu":
        unclaimed = unclaimed_accelerator(registry)
        if unclaimed is not None:
            raise BackendSelectionError(unclaimed)
    logger.info(
        "graphcap: selected backend %r (highest-priority available backend; %s unset)",
        best.name,
        ENV_VAR,
    )
    return best.name


def get_backend(name: str | None = None) -> Backend:
    """The backend to run on: ``name``, else ``$GRAPHCAP_BACKEND``, else auto-detected.

    The same object is returned for the same name, so engines share its capture stream.

    Auto-detection takes the available backend of highest priority (accelerators before cpu).
    Raises :class:`BackendSelectionError` with the list of installed backends, and why each is
    or is not available, when the choice cannot be honoured.
    """
    registry = discover()
    requested = name or os.environ.get(ENV_VAR) or None
    chosen = _select_name(registry, requested)
    record = registry.backends.get(chosen)
    if record is None:
        failure = registry.failure_for(chosen)
        why = (
            f"its plugin from {failure.distribution} is broken: {failure.error}"
            if failure
            else f"no installed plugin provides it{_install_hint(chosen)}"
        )
        raise BackendSelectionError(
            f"graphcap backend {chosen!r} cannot be used: {why}.\n"
            f"Installed backends:\n{registry.describe()}"
        )
    avail = record.availability()
    if not avail.ok:
        raise BackendSelectionError(
            f"graphcap backend {chosen!r} is installed but unavailable here: {avail.reason}.\n"
            f"Installed backends:\n{registry.describe()}"
        )
    backend = registry.instances.get(chosen)
    if backend is None:
        backend = registry.instances[chosen] = _instantiate(record)
    return backend


def _install_hint(name: str) -> str:
    hint = PLUGIN_HINTS.get(name)
    return f"; install {hint}" if hint else ""


def _instantiate(record: BackendRecord) -> Backend:
    backend = record.cls()
    backend.distribution = record.distribution
    backend.distribution_version = record.version
    return backend


def attention_implementations(backend: Backend) -> dict[str, Callable[..., Any]]:
    """Attention functions the plugins offer for ``backend`` (merged, name -> callable)."""
    merged: dict[str, Callable[..., Any]] = {}
    results = discover().plugin_manager.hook.graphcap_attention_implementations(backend=backend)
    for offered in results:
        merged.update(offered or {})
    return merged


def register_attention_implementations(backend: Backend) -> list[str]:
    """Register the attention functions plugins offer for ``backend`` with transformers.

    Each name also gets transformers' SDPA mask function: for an attention name without one,
    transformers builds no mask at all, and padding and causality would silently vanish. Returns
    the names; load or configure a model with ``attn_implementation=<name>`` to use one.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    offered = attention_implementations(backend)
    for name, function in offered.items():
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)
    return list(offered)
