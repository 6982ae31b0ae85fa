"""Multi-rank testing for hyperfsdp and its plugins (also a pytest plugin).

``run_on_ranks(world_size, fn, *args)`` runs the module-level function ``fn`` on
``world_size`` CPU processes that share a gloo default process group, and returns
each rank's return value. Processes are kept alive between calls; ``spawn_ranks`` starts
such processes for a driver of its own (the benchmark suite's). ``registered(plugin,
name)`` registers a throwaway plugin for the duration of a ``with`` block;
``shared_memory(enabled)`` turns the ``hyperfsdp-shm`` plugin's shared-memory collectives
on or off for one.
``streams.simulated_accelerator()`` runs the accelerator code path on a simulated device
that checks stream ordering.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .pool import (
    DEFAULT_TIMEOUT,
    RankFailure,
    RankTimeout,
    close_pools,
    current_rank,
    run_on_ranks,
    spawn_ranks,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "RankFailure",
    "RankTimeout",
    "close_pools",
    "current_rank",
    "registered",
    "run_on_ranks",
    "shared_memory",
    "spawn_ranks",
]


@contextlib.contextmanager
def registered(plugin: object, name: str) -> Iterator[object]:
    """Register ``plugin`` in the process-wide plugin manager under ``name`` for the
    ``with`` block (unregistered in ``finally``); yields the manager."""
    from ..plugin.manager import get_plugin_manager

    pm = get_plugin_manager()
    pm.register(plugin, name=name)
    try:
        yield pm
    finally:
        pm.unregister(plugin)


@contextlib.contextmanager
def shared_memory(enabled: bool) -> Iterator[None]:
    """Whether roots lazily initialized inside the ``with`` block move their gloo
    collectives through shared memory (the default where the ranks share a host and the
    ``hyperfsdp-shm`` plugin is installed) or through the core's gloo routes (as
    ``HYPERFSDP_SHM=0`` does for a whole run: the plugin reads it at each root's lazy
    init, and supplies no transport). With shared memory a collective runs in line when it is issued, so the core
    does not prefetch the next unit's all-gather; test both where that matters."""
    import os

    saved = os.environ.get("HYPERFSDP_SHM")
    os.environ["HYPERFSDP_SHM"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("HYPERFSDP_SHM", None)
        else:
            os.environ["HYPERFSDP_SHM"] = saved
