"""Plugin discovery and backend selection.

Plugins are found through the entry-point group ``graphcap``. Each entry point is loaded inside
its own guard and then registered with pluggy (pluggy's bulk loader would abort on the first
broken plugin), so one broken plugin is reported and skipped instead of breaking the others.
"""

from __future__ import annotations

import difflib
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
from graphcap.errors import BackendSelectionError, PluginError

logger = logging.getLogger("graphcap")

ENV_VAR = "GRAPHCAP_BACKEND"

#: Where to get a plugin for a device torch can see; used when none is installed. The plugins
#: are on no package index: the command runs in the graphcap repository (graphcap, being
#: installed, satisfies the plugin's requirement).
PLUGIN_HINTS: dict[str, str] = {
    "cuda": "graphcap-cuda (in the graphcap repository root: pip install ./backends/cuda)",
    "npu": "graphcap-npu (in the graphcap repository root: pip install ./backends/npu)",
}


@dataclass
class BackendRecord:
    """One backend class offered by one plugin, with where it came from."""

    name: str
    cls: type[Backend]
    distribution: str
    version: str
    #: The entry point (pluggy plugin name) that offered it.
    entry_point: str = ""

    def availability(self) -> Availability:
        """The class's own answer, checked: a probe that raises or returns garbage says no."""
        try:
            return _checked_availability(self.cls)
        except _PluginFault as fault:
            return Availability(False, f"broken plugin: {fault}")


@dataclass
class PluginFailure:
    """A plugin that cannot be used: it failed to import, speaks another API version, or one of
    its hooks or backends raised or returned the wrong thing. Its backends are not offered."""

    entry_point: str
    distribution: str
    error: str
    #: Names of the backends it offered before it was found broken (empty if it never did).
    backends: list[str] = field(default_factory=list)
    #: Device types those backends claimed (so an accelerator they claimed is not "unclaimed").
    device_types: list[str] = field(default_factory=list)


class _PluginFault(Exception):
    """A plugin broke its contract; the message says which hook and how."""


def _guarded(what: str, call: Callable[[], Any]) -> Any:
    """``call()``, with anything it raises turned into a :class:`_PluginFault` naming ``what``."""
    try:
        return call()
    except Exception as exc:
        raise _PluginFault(f"{what} raised {type(exc).__name__}: {exc}") from exc


def _checked_availability(cls: type[Backend]) -> Availability:
    answer = _guarded(f"{cls.__name__}.availability()", cls.availability)
    if not isinstance(answer, Availability):
        raise _PluginFault(
            f"{cls.__name__}.availability() returned {type(answer).__name__} {answer!r}, "
            "not graphcap.Availability(ok, reason)"
        )
    return answer


@dataclass
class Registry:
    plugin_manager: pluggy.PluginManager
    backends: dict[str, BackendRecord] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    #: One backend object per name, shared by every caller (its capture stream included).
    instances: dict[str, Backend] = field(default_factory=dict)
    #: Entry point name -> (distribution, version) of every plugin that got past import.
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)

    def failure_for(self, name: str) -> PluginFailure | None:
        """The failure of the plugin called ``name`` or of the one that offered backend ``name``."""
        return next((f for f in self.failures if name in (f.entry_point, *f.backends)), None)

    def label(self, entry_point: str) -> str:
        """How errors name a plugin: entry point and distribution."""
        return f"plugin {entry_point!r} from {self.sources.get(entry_point, ('unknown', ''))[0]}"

    def report_broken(self, entry_point: str, error: str) -> PluginFailure:
        """Record a broken plugin once, warn, withdraw its backends and unregister its hooks."""
        known = next((f for f in self.failures if f.entry_point == entry_point), None)
        if known is not None:
            return known
        withdrawn = [r for r in self.backends.values() if r.entry_point == entry_point]
        for record in withdrawn:
            del self.backends[record.name]
            self.instances.pop(record.name, None)
        plugin = self.plugin_manager.get_plugin(entry_point)
        if plugin is not None:
            self.plugin_manager.unregister(plugin=plugin, name=entry_point)
        distribution = self.sources.get(entry_point, ("unknown", ""))[0]
        failure = PluginFailure(
            entry_point,
            distribution,
            error,
            [r.name for r in withdrawn],
            sorted({r.cls.device_type for r in withdrawn}),
        )
        self.failures.append(failure)
        warnings.warn(
            f"graphcap {self.label(entry_point)} is broken and was skipped: {error}",
            stacklevel=3,
        )
        return failure

    def availability(self, record: BackendRecord) -> Availability:
        """The record's availability; a probe that raises or returns garbage breaks the plugin."""
        try:
            return _checked_availability(record.cls)
        except _PluginFault as fault:
            self.report_broken(record.entry_point, str(fault))
            return Availability(False, f"broken plugin: {fault}")

    def instance(self, record: BackendRecord) -> Backend:
        """The shared backend object of ``record``, built (and its capabilities probed) once.

        A constructor or ``create_graph()`` that raises breaks the plugin and raises
        :class:`BackendSelectionError` naming it, so a caller choosing among several moves on.
        """
        backend = self.instances.get(record.name)
        if backend is not None:
            return backend
        try:
            backend = _guarded(f"{record.cls.__name__}()", record.cls)
            backend.distribution = record.distribution
            backend.distribution_version = record.version
            _guarded(f"{record.cls.__name__}.device", lambda: backend.device)
            _guarded(f"{record.cls.__name__}.create_graph()", lambda: backend.capabilities)
        except _PluginFault as fault:
            failure = self.report_broken(record.entry_point, str(fault))
            raise BackendSelectionError(
                f"graphcap backend {record.name!r} cannot be used: its "
                f"{self.label(record.entry_point)} is broken: {failure.error}"
            ) from fault.__cause__
        self.instances[record.name] = backend
        return backend

    def describe_backends(self) -> list[dict[str, Any]]:
        """One row per usable backend for ``graphcap info`` (plugins found broken on the way
        are reported and left out: they are in :attr:`failures`)."""
        rows = []
        for record in sorted(self.backends.values(), key=lambda r: (-r.cls.priority, r.name)):
            availability = self.availability(record)
            if record.name not in self.backends:
                continue
            if not availability.ok:
                rows.append(
                    {
                        "name": record.name,
                        "distribution": record.distribution,
                        "version": record.version,
                        "priority": record.cls.priority,
                        "available": False,
                        "reason": availability.reason,
                    }
                )
                continue
            try:
                backend = self.instance(record)
                rows.append(_guarded(f"{type(backend).__name__}.describe()", backend.describe))
            except BackendSelectionError:
                continue
            except _PluginFault as fault:
                self.report_broken(record.entry_point, str(fault))
        return rows

    def describe(self) -> str:
        """One line per installed backend and per broken plugin: what is there and why."""
        lines = []
        for record in sorted(self.backends.values(), key=lambda r: -r.cls.priority):
            avail = self.availability(record)
            if record.name not in self.backends:
                continue
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


def _offered_backends(plugin: Any, registry: Registry, distribution: str) -> list[type[Backend]]:
    """The plugin's backend classes, checked whole: garbage or a taken name refuses them all."""
    offered = plugin.graphcap_backends()
    if offered is None:
        return []
    if not isinstance(offered, (list, tuple)):
        raise _PluginFault(
            f"graphcap_backends() returned {type(offered).__name__} {offered!r}, not a list of "
            "graphcap.Backend subclasses"
        )
    taken = {name.casefold(): r.distribution for name, r in registry.backends.items()}
    classes: list[type[Backend]] = []
    for cls in offered:
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise _PluginFault(
                f"graphcap_backends() returned {cls!r}, which is not a graphcap.Backend subclass"
            )
        if not (isinstance(cls.name, str) and cls.name.strip() == cls.name and cls.name):
            raise _PluginFault(
                f"{cls.__name__}.name is {cls.name!r}; it must be a non-empty name without "
                "surrounding spaces"
            )
        if not isinstance(cls.priority, int) or isinstance(cls.priority, bool):
            raise _PluginFault(f"{cls.__name__}.priority is {cls.priority!r}, not an int")
        if cls in classes:
            continue
        owner = taken.get(cls.name.casefold())
        if owner is not None:
            raise _PluginFault(
                f"backend name {cls.name!r} is offered by both {owner} and {distribution}; "
                f"keeping the one from {owner}. Uninstall one of them."
            )
        taken[cls.name.casefold()] = distribution
        classes.append(cls)
    return classes


def _register(
    registry: Registry, plugin: Any, ep_name: str, distribution: str, version: str
) -> None:
    """Check one plugin and add it whole (hooks and backends), or report it broken."""
    registry.sources[ep_name] = (distribution, version)
    try:
        refusal = _check_api_version(plugin)
        if refusal is not None:
            raise _PluginFault(f"refused: {refusal}")
        # Ask this plugin alone (not the whole hook) so each backend is tied to its distribution.
        classes = _offered_backends(plugin, registry, distribution)
        registry.plugin_manager.register(plugin, name=ep_name)
    except _PluginFault as fault:
        registry.report_broken(ep_name, str(fault))
        return
    except Exception as exc:
        registry.report_broken(ep_name, f"its hooks raised {type(exc).__name__}: {exc}")
        return
    for cls in classes:
        registry.backends[cls.name] = BackendRecord(cls.name, cls, distribution, version, ep_name)


def _load_entry_points(registry: Registry, entry_points: Iterable[metadata.EntryPoint]) -> None:
    for ep in entry_points:
        distribution, version = _distribution_of(ep)
        if ep.name in registry.sources:  # pluggy knows a plugin by this name only once
            first = registry.sources[ep.name][0]
            error = f"entry point name {ep.name!r} is already used by {first}; uninstall one"
            registry.failures.append(PluginFailure(ep.name, distribution, error))
            warnings.warn(f"graphcap plugin from {distribution} was skipped: {error}", stacklevel=2)
            continue
        try:
            plugin = ep.load()
        except BaseException as exc:  # a plugin may even call exit() on import
            if isinstance(exc, KeyboardInterrupt):
                raise
            registry.sources[ep.name] = (distribution, version)
            registry.report_broken(
                ep.name, f"import of {ep.value!r} raised {type(exc).__name__}: {exc}"
            )
            continue
        _register(registry, plugin, ep.name, distribution, version)


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
    """A sentence when torch sees an accelerator that no usable backend claims, else None."""
    device_type = visible_accelerator()
    if device_type is None:
        return None
    if any(r.cls.device_type == device_type for r in registry.backends.values()):
        return None
    broken = [f for f in registry.failures if device_type in f.device_types]
    if broken:
        failure = broken[0]
        return (
            f"torch sees a {device_type!r} accelerator, but the backend that claims it "
            f"({', '.join(failure.backends)}, {registry.label(failure.entry_point)}) is broken: "
            f"{failure.error}. Fix or reinstall that plugin, or set {ENV_VAR}=cpu to run on the "
            "CPU deliberately."
        )
    hint = PLUGIN_HINTS.get(device_type, f"a graphcap plugin for {device_type!r}")
    return (
        f"torch sees a {device_type!r} accelerator, but no installed graphcap backend claims it. "
        f"Install {hint}, or set {ENV_VAR}=cpu to run on the CPU deliberately."
    )


def _auto_select(registry: Registry) -> Backend:
    """The available backend of highest priority whose plugin works; broken ones are skipped."""
    records = sorted(registry.backends.values(), key=lambda r: -r.cls.priority)
    for record in [r for r in records if registry.availability(r).ok]:
        if record.name not in registry.backends:
            continue
        if record.cls.device_type == "cpu":
            unclaimed = unclaimed_accelerator(registry)
            if unclaimed is not None:
                raise BackendSelectionError(unclaimed)
        try:
            backend = registry.instance(record)
        except BackendSelectionError:
            continue  # reported (warning + failure row); try the next one
        logger.info(
            "graphcap: selected backend %r (highest-priority available backend; %s unset)",
            record.name,
            ENV_VAR,
        )
        return backend
    raise BackendSelectionError(
        f"no graphcap backend can be used here.\nInstalled backends:\n{registry.describe()}"
    )


def _resolve_name(registry: Registry, requested: str) -> str:
    """The installed (or known broken) name meant by ``requested``: spaces and case ignored.

    Raises :class:`BackendSelectionError` for an unknown name, suggesting the close match.
    """
    known = [*registry.backends, *(n for f in registry.failures for n in f.backends)]
    known += [f.entry_point for f in registry.failures if f.entry_point not in known]
    wanted = requested.strip()
    for name in known:
        if name.casefold() == wanted.casefold():
            return name
    if wanted in PLUGIN_HINTS or wanted.casefold() in PLUGIN_HINTS:
        return wanted.casefold()
    folded = {n.casefold(): n for n in known}
    close = difflib.get_close_matches(wanted.casefold(), list(folded), n=1)
    suggestion = f" Did you mean {folded[close[0]]!r}?" if close else ""
    raise BackendSelectionError(
        f"graphcap backend {wanted!r} cannot be used: no installed plugin provides it."
        f"{suggestion}{_install_hint(wanted)}\nInstalled backends:\n{registry.describe()}"
    )


def get_backend(name: str | None = None) -> Backend:
    """The backend to run on: ``name``, else ``$GRAPHCAP_BACKEND``, else auto-detected.

    The same object is returned for the same name, so engines share its capture stream. Names
    are matched without surrounding spaces and case-insensitively (``" CPU"`` is ``cpu``).

    Auto-detection takes the available backend of highest priority (accelerators before cpu),
    skipping (and reporting) one whose plugin turns out broken. Raises
    :class:`BackendSelectionError` with the list of installed backends, and why each is or is
    not available, when the choice cannot be honoured.
    """
    registry = discover()
    requested = (name or os.environ.get(ENV_VAR) or "").strip()
    if not requested:
        return _auto_select(registry)
    chosen = _resolve_name(registry, requested)
    record = registry.backends.get(chosen)
    avail = registry.availability(record) if record is not None else None
    if record is None or chosen not in registry.backends:  # missing, or its plugin broken
        raise _cannot_use(registry, chosen)
    if not avail:
        raise BackendSelectionError(
            f"graphcap backend {chosen!r} is installed but unavailable here: {avail.reason}.\n"
            f"Installed backends:\n{registry.describe()}"
        )
    return registry.instance(record)


def backend_for_device(device_type: str) -> Backend:
    """The backend a tensor on ``device_type`` is served by: the one ``$GRAPHCAP_BACKEND``
    names where it runs on that device (as engines select it), else the available backend of
    highest priority that does.

    Raises :class:`BackendSelectionError` naming the installed backends when none does."""
    registry = discover()
    requested = os.environ.get(ENV_VAR, "").strip()
    if requested:
        try:
            named = get_backend(requested)
        except BackendSelectionError:
            named = None
        if named is not None and named.device_type == device_type:
            return named
    records = sorted(registry.backends.values(), key=lambda r: -r.cls.priority)
    for record in records:
        if record.cls.device_type != device_type or not registry.availability(record).ok:
            continue
        try:
            return registry.instance(record)
        except BackendSelectionError:
            continue  # reported; try the next one
    raise BackendSelectionError(
        f"no available graphcap backend runs on {device_type!r}{_install_hint(device_type)}."
        f"\nInstalled backends:\n{registry.describe()}"
    )


def _cannot_use(registry: Registry, name: str) -> BackendSelectionError:
    failure = registry.failure_for(name)
    why = (
        f"its {registry.label(failure.entry_point)} is broken: {failure.error}"
        if failure
        else f"no installed plugin provides it{_install_hint(name)}"
    )
    return BackendSelectionError(
        f"graphcap backend {name!r} cannot be used: {why}.\n"
        f"Installed backends:\n{registry.describe()}"
    )


def _install_hint(name: str) -> str:
    hint = PLUGIN_HINTS.get(name.casefold())
    return f"; install {hint}" if hint else ""


def _owner(registry: Registry, backend: Backend) -> str | None:
    """The entry point of the plugin that offered ``backend``'s class, if one did."""
    record = registry.backends.get(backend.name)
    return record.entry_point if record is not None and isinstance(backend, record.cls) else None


def _offered_attention(offered: Any) -> dict[str, Callable[..., Any]]:
    if offered is None:
        return {}
    if not isinstance(offered, dict) or not all(
        isinstance(k, str) and k and callable(v) for k, v in offered.items()
    ):
        raise _PluginFault(
            f"graphcap_attention_implementations() returned {offered!r}, not a dict of "
            "name -> attention function"
        )
    return offered


def attention_implementations(backend: Backend) -> dict[str, Callable[..., Any]]:
    """Attention functions the plugins offer for ``backend`` (merged, name -> callable).

    Each plugin's hook is called on its own: one that raises or returns garbage is reported
    broken and skipped, unless it is the plugin of ``backend`` itself, whose fault is an error.
    """
    registry = discover()
    owner = _owner(registry, backend)
    merged: dict[str, Callable[..., Any]] = {}
    caller = registry.plugin_manager.hook.graphcap_attention_implementations
    # In pluggy's call order (last registered first), so the first registered wins a name clash.
    for impl in reversed(caller.get_hookimpls()):
        what = f"graphcap_attention_implementations(backend={backend.name!r})"
        try:
            offered = _offered_attention(
                _guarded(
                    what, lambda impl=impl: impl.function(**{arg: backend for arg in impl.argnames})
                )
            )
        except _PluginFault as fault:
            if impl.plugin_name == owner:
                raise PluginError(
                    f"the {registry.label(owner)}, which provides the selected backend "
                    f"{backend.name!r}, is broken: {fault}"
                ) from fault.__cause__
            registry.report_broken(impl.plugin_name, str(fault))
            continue
        merged.update(offered)
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
