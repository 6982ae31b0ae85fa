"""The public API for hyperfsdp plugin authors (work in progress: see issue 10)."""

from ._plugins import (
    FIRST_PHASE,
    Phase,
    PhaseOrderError,
    PluginLoadError,
    build_plugin_manager,
    get_plugin_manager,
    hookimpl,
)

__all__ = [
    "FIRST_PHASE",
    "Phase",
    "PhaseOrderError",
    "PluginLoadError",
    "build_plugin_manager",
    "get_plugin_manager",
    "hookimpl",
]
