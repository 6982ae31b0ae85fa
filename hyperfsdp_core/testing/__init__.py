"""Multi-rank testing for hyperfsdp and its plugins (also a pytest plugin).

``run_on_ranks(world_size, fn, *args)`` runs the module-level function ``fn`` on
``world_size`` CPU processes that share a gloo default process group, and returns
each rank's return value. Processes are kept alive between calls. ``registered(plugin,
name)`` registers a throwaway plugin for the duration of a ``with`` block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .pool import RankFailure, RankTimeout, close_pools, current_rank, run_on_ranks

__all__ = [
    "RankFailure",
    "RankTimeout",
    "close_pools",
    "current_rank",
    "registered",
    "run_on_ranks",
]


@contextlib.contextmanager
def registered(plugin: object, name: str) -> Iterator[object]:
    """Register ``plugin`` in the process-wide plugin manager under ``name`` for the
    ``with`` block (unregistered in ``finally``); yields the manager."""
    from .._plugins import get_plugin_manager

    pm = get_plugin_manager()
    pm.register(plugin, name=name)
    try:
        yield pm
    finally:
        pm.unregister(plugin)
