"""The process-wide plugin manager: which plugins it loads (the builtin ones, then the
entry points, less those disabled), what it tells about them (where each came from,
first-result hooks several answer), and the finalization phases they declare. The API
versions a plugin is checked against live in ``versions.py``, the ordering of phases in
``phases.py``."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import threading
import warnings
from collections.abc import Iterable
from typing import Any

import attrs
import pluggy

from . import hookspecs
from .phases import Phase, PhaseOrderError, order_phases
from .versions import (
    PluginLoadError,
    check_api,
)

PROJECT_NAME = "hyperfsdp"
ENTRY_POINT_GROUP = "hyperfsdp"
#: Set to a non-empty value to skip loading plugins from entry points.
DISABLE_AUTOLOAD_ENV = "HYPERFSDP_DISABLE_PLUGIN_AUTOLOAD"
#: Plugin names (entry-point names, comma- or space-separated) not to load in this process.
PLUGINS_DISABLE_ENV = "HYPERFSDP_PLUGINS_DISABLE"
#: Plugins that ship with the core, registered before any entry point: (name, module).
BUILTIN_PLUGINS = (
    ("hyperfsdp.core", "hyperfsdp_core.plugin.builtin.core"),
    ("hyperfsdp.mixed_precision", "hyperfsdp_core.plugin.builtin.mixed_precision"),
)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class PluginSelectionError(ValueError):
    """The plugins asked to be disabled cannot be (a builtin plugin of the core)."""


class PluginSelectionWarning(UserWarning):
    """A plugin asked to be disabled is not installed (a typo?)."""


@attrs.frozen
class PluginInfo:
    name: str
    distribution: str
    version: str


class HyperFSDPPluginManager(pluggy.PluginManager):
    """A pluggy manager that keeps the resolved finalization order up to date.

    After the initial load, every ``register``/``unregister`` re-resolves the phase
    order; a registration that makes the order invalid is rolled back and raises.
    """

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self._sealed = False
        self._phases: tuple[Phase, ...] | None = None
        self._phase_owners: dict[str, str] = {}
        #: Whether entry-point plugins were loaded (see :data:`DISABLE_AUTOLOAD_ENV`).
        self.autoloaded = False
        self._distinfo: dict[str, PluginInfo] = {}
        #: Plugin names disabled in this manager (see :data:`PLUGINS_DISABLE_ENV`), each with
        #: the installed entry point of that name (``None``: no installed plugin has it).
        self.disabled: dict[str, PluginInfo | None] = {}
        #: Where :attr:`disabled` came from: the environment variable or ``disable=``.
        self.disabled_by = PLUGINS_DISABLE_ENV
        #: Incremented on every change, so caches built from hooks can tell they are stale.
        self.generation = 0

    def register(self, plugin: object, name: str | None = None) -> str | None:
        check_api(plugin, name, required=False)
        plugin_name = super().register(plugin, name)
        self._changed()
        if self._sealed:
            try:
                self.check_pending()
                self._resolve()
            except Exception:
                self.unregister(plugin)
                raise
        return plugin_name

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        if name is None and plugin is not None:
            name = self.get_name(plugin)
        result = super().unregister(plugin, name)
        if name is not None:
            self._distinfo.pop(name, None)  # a later plugin of that name has its own origin
        self._changed()
        return result

    def _changed(self) -> None:
        self._phases = None
        self.generation += 1

    def seal(self) -> None:
        """End the initial load: validate hooks and phase order once for everything loaded."""
        self.check_pending()
        self._resolve()
        self._sealed = True

    def finalization_phases(self) -> tuple[Phase, ...]:
        """The phases in the order the root runs them."""
        if self._phases is None:
            self._resolve()
        assert self._phases is not None
        return self._phases

    def phase_owners(self) -> dict[str, str]:
        """Phase name -> name of the plugin that declares it."""
        self.finalization_phases()
        return dict(self._phase_owners)

    def plugin_infos(self) -> list[PluginInfo]:
        """Registered plugins with the distribution each came from."""
        infos = []
        for name, plugin in self.list_name_plugin():
            if plugin is None:
                continue
            info = self._distinfo.get(name)
            if info is None:
                builtin = name in dict(BUILTIN_PLUGINS)
                info = PluginInfo(
                    name, "hyperfsdp" if builtin else "-", _version("hyperfsdp") if builtin else "-"
                )
            infos.append(info)
        return infos

    def first_result_hooks(self) -> dict[str, list[tuple[str, str]]]:
        """Each *first result* hook -> ``(plugin name, kind)`` of its implementations in
        the order pluggy calls them (wrappers first, then tryfirst, normal, trylast, newest
        registration first within each); ``kind`` is ``""``, ``"tryfirst"``, ``"trylast"``,
        or ``"wrapper"`` (possibly ``"wrapper, tryfirst"`` ...)."""
        hooks: dict[str, list[tuple[str, str]]] = {}
        for name in sorted(vars(self.hook)):
            caller = getattr(self.hook, name)
            spec = getattr(caller, "spec", None)
            if spec is None or not spec.opts.get("firstresult"):
                continue
            impls = []
            for impl in reversed(caller.get_hookimpls()):
                kind = ["wrapper"] if impl.wrapper or impl.hookwrapper else []
                kind += [k for k in ("tryfirst", "trylast") if getattr(impl, k)]
                impls.append((impl.plugin_name, ", ".join(kind)))
            hooks[name] = impls
        return hooks

    def first_result_conflicts(self) -> dict[str, list[str]]:
        """*First result* hooks answered by more than one plugin (wrappers and the core's
        ``trylast`` defaults aside) -> those plugins, the one asked first first."""
        conflicts = {}
        for hook, impls in self.first_result_hooks().items():
            names = [
                name
                for name, kind in impls
                if "wrapper" not in kind and not (name == "hyperfsdp.core" and kind == "trylast")
            ]
            if len(names) > 1:
                conflicts[hook] = names
        return conflicts

    def _resolve(self) -> None:
        try:
            self._phases, self._phase_owners = self._order()
        except PhaseOrderError as exc:
            raise PhaseOrderError(
                f"{exc}{self._disable_hint(exc.plugins)}", plugins=exc.plugins
            ) from None

    def _order(self) -> tuple[tuple[Phase, ...], dict[str, str]]:
        owners: dict[str, str] = {}
        phases: dict[str, Phase] = {}
        for impl in self.hook.hyperfsdp_finalize_phases.get_hookimpls():
            for phase in impl.function() or ():
                if not isinstance(phase, Phase):
                    raise PhaseOrderError(
                        f"plugin {impl.plugin_name!r} returned {phase!r} from "
                        "hyperfsdp_finalize_phases; expected hyperfsdp_core.plugin.Phase",
                        plugins=[impl.plugin_name],
                    )
                if phase.name in phases:
                    raise PhaseOrderError(
                        f"phase {phase.name!r} is declared twice: by plugin "
                        f"{owners[phase.name]!r} and by plugin {impl.plugin_name!r}",
                        plugins=[owners[phase.name], impl.plugin_name],
                    )
                phases[phase.name] = phase
                owners[phase.name] = impl.plugin_name
        return order_phases(phases, owners), owners

    def _disable_hint(self, plugins: Iterable[str]) -> str:
        """How to get going without the installed plugins among ``plugins``."""
        installed = [name for name in plugins if name in self._distinfo]
        if not installed:
            return ""
        listing = ", ".join(
            f"{name!r} (distribution {self._distinfo[name].distribution!r} "
            f"{self._distinfo[name].version})"
            for name in installed
        )
        choices = " or ".join(f"{PLUGINS_DISABLE_ENV}={name}" for name in installed)
        which = "it" if len(installed) == 1 else "one of them"
        return (
            f". Installed plugins involved: {listing}. To run without {which}, set "
            f"{choices} (or uninstall it), and report the conflict to the plugins' authors"
        )


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)


def _dist_of(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown distribution", "unknown"
    return dist.metadata["Name"], dist.version


def _load_entry_points(pm: HyperFSDPPluginManager) -> None:
    for ep in _entry_points():
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        dist_name, dist_version = _dist_of(ep)
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginLoadError(
                f"hyperfsdp plugin {ep.name!r} from distribution {dist_name!r} "
                f"{dist_version} failed to import ({ep.value}): {type(exc).__name__}: {exc}. "
                f"Reinstall or uninstall {dist_name!r}, or set {PLUGINS_DISABLE_ENV}={ep.name} "
                f"to skip this plugin ({DISABLE_AUTOLOAD_ENV}=1 skips all of them)."
            ) from exc
        check_api(
            plugin, ep.name, required=True, origin=f"distribution {dist_name!r} {dist_version}"
        )
        pm.register(plugin, name=ep.name)
        pm._distinfo[ep.name] = PluginInfo(ep.name, dist_name, dist_version)


def parse_plugin_names(text: str) -> tuple[str, ...]:
    """Plugin names from a comma- or whitespace-separated list, duplicates dropped."""
    return tuple(dict.fromkeys(n for n in re.split(r"[,\s]+", text) if n))


def _disabled_names(disable: str | Iterable[str] | None) -> tuple[tuple[str, ...], str]:
    if disable is None:
        return parse_plugin_names(os.environ.get(PLUGINS_DISABLE_ENV, "")), PLUGINS_DISABLE_ENV
    if isinstance(disable, str):
        return parse_plugin_names(disable), "disable="
    return tuple(dict.fromkeys(disable)), "disable="


def _disable(pm: HyperFSDPPluginManager, names: tuple[str, ...], source: str) -> None:
    """Block ``names`` in ``pm`` (before anything is registered) and record them."""
    builtin = [name for name in names if name in dict(BUILTIN_PLUGINS)]
    if builtin:
        raise PluginSelectionError(
            f"{source} names {', '.join(map(repr, builtin))}, a builtin plugin of hyperfsdp's "
            "core, which cannot be disabled: the core relies on it (hyperfsdp.core validates "
            "fully_shard's input, lays out the parameters and drains the reduce-scatters; "
            "hyperfsdp.mixed_precision implements MixedPrecisionPolicy). Remove it from "
            f"{source}; only the plugins of installed distributions can be disabled"
        )
    pm.disabled_by = source
    if not names:
        return
    installed = {ep.name: PluginInfo(ep.name, *_dist_of(ep)) for ep in _entry_points()}
    for name in names:
        pm.set_blocked(name)
        pm.disabled[name] = installed.get(name)
    unknown = [name for name in names if name not in installed]
    if unknown:
        known = ", ".join(sorted(installed)) or "none"
        warnings.warn(
            f"{source} names {', '.join(map(repr, unknown))}, but no installed hyperfsdp "
            f"plugin has that name (installed entry-point plugins: {known}); check the "
            "spelling. A plugin registered at run time under that name is refused as well",
            PluginSelectionWarning,
            stacklevel=5,  # get_plugin_manager()'s caller
        )


def _build(
    autoload: bool | None, disable: str | Iterable[str] | None, seal: bool
) -> HyperFSDPPluginManager:
    pm = HyperFSDPPluginManager()
    _disable(pm, *_disabled_names(disable))
    for name, module_name in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(module_name), name=name)
    if autoload is None:
        autoload = not os.environ.get(DISABLE_AUTOLOAD_ENV)
    if autoload:
        _load_entry_points(pm)
        pm.autoloaded = True
    if seal:
        pm.seal()
    return pm


def build_plugin_manager(
    *, autoload: bool | None = None, disable: str | Iterable[str] | None = None
) -> HyperFSDPPluginManager:
    """A new manager with the builtin plugins and (unless disabled) the entry-point plugins.

    :param autoload: load entry-point plugins; ``None`` unless :data:`DISABLE_AUTOLOAD_ENV`
        is set.
    :param disable: plugin names not to load (nor to register later), as a list or a
        comma-separated string; ``None`` reads :data:`PLUGINS_DISABLE_ENV`. Naming a
        builtin plugin raises :class:`PluginSelectionError`; a name no installed plugin
        has warns.
    :raises PluginLoadError: a plugin failed to import or does not support this API.
    :raises PhaseOrderError: the plugins' finalization phases cannot be ordered.
    """
    return _build(autoload, disable, seal=True)


def build_unsealed_plugin_manager() -> HyperFSDPPluginManager:
    """The process-wide manager's plugins, loaded as :func:`get_plugin_manager` would but
    without ordering the phases: for reporting a :class:`PhaseOrderError`."""
    return _build(None, None, seal=False)


_lock = threading.Lock()
_manager: HyperFSDPPluginManager | None = None


def get_plugin_manager() -> HyperFSDPPluginManager:
    """The process-wide plugin manager, built on first use."""
    global _manager
    if _manager is None:
        with _lock:
            if _manager is None:
                _manager = build_plugin_manager()
    return _manager


def reset_plugin_manager() -> None:
    """Forget the process-wide manager; the next :func:`get_plugin_manager` rebuilds it."""
    global _manager
    with _lock:
        _manager = None
