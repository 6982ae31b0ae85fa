"""Finalization phases as data (a leaf: imports nothing of hyperfsdp): :class:`Phase`,
the core's :data:`FIRST_PHASE`, and their ordering (:func:`order_phases`)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from graphlib import CycleError, TopologicalSorter
from typing import Any

import attrs

#: The core's own phase; every other phase runs after it.
FIRST_PHASE = "core.reduce_scatter_drain"


def _names(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@attrs.frozen
class Phase:
    """One finalization step, declared as data by a plugin.

    ``run(root)`` is called with the root's :class:`~hyperfsdp_core.plugin.RootView`
    at the end of every backward. ``after``/``before`` name phases that must exist;
    ``after_if_present``/``before_if_present`` order against phases of plugins that
    may not be installed.
    """

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    run: Callable[[Any], None] = attrs.field(eq=False)
    after: tuple[str, ...] = attrs.field(default=(), converter=_names)
    before: tuple[str, ...] = attrs.field(default=(), converter=_names)
    after_if_present: tuple[str, ...] = attrs.field(default=(), converter=_names)
    before_if_present: tuple[str, ...] = attrs.field(default=(), converter=_names)


class PhaseOrderError(ValueError):
    """The declared finalization phases cannot be ordered.

    ``plugins`` names the plugins involved (the owners of the phases in a cycle, say).
    """

    def __init__(self, message: str, *, plugins: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.plugins: tuple[str, ...] = tuple(dict.fromkeys(plugins))


def order_phases(phases: dict[str, Phase], owners: dict[str, str]) -> tuple[Phase, ...]:
    """Topologically order ``phases``; ties go to the smaller name.

    :raises PhaseOrderError: on a cycle, an unknown name, or a phase placed before
        the core's first phase; the message names the plugins involved.
    """
    graph: dict[str, set[str]] = {name: set() for name in phases}
    #: (earlier, later) -> the declaration that orders them, for cycle reports
    why: dict[tuple[str, str], str] = {}
    for name, phase in phases.items():
        for ref in phase.after + phase.before:
            if ref not in phases:
                raise PhaseOrderError(
                    f"phase {name!r} of plugin {owners[name]!r} refers to unknown phase "
                    f"{ref!r}; known phases: {sorted(phases)}. Install the plugin that "
                    "declares it, or use after_if_present=/before_if_present=",
                    plugins=[owners[name]],
                )
        for field in ("after", "after_if_present"):
            for ref in getattr(phase, field):
                if ref in phases:
                    graph[name].add(ref)
                    why.setdefault((ref, name), f"{name!r} declares {field}={ref!r}")
        for field in ("before", "before_if_present"):
            for ref in getattr(phase, field):
                if ref not in phases:
                    continue
                if ref == FIRST_PHASE:
                    raise PhaseOrderError(
                        f"phase {name!r} of plugin {owners[name]!r} asks to run before "
                        f"{FIRST_PHASE!r}, which always runs first",
                        plugins=[owners[name]],
                    )
                graph[ref].add(name)
                why.setdefault((name, ref), f"{name!r} declares {field}={ref!r}")
        if FIRST_PHASE in phases and name != FIRST_PHASE:
            graph[name].add(FIRST_PHASE)
    sorter = TopologicalSorter(graph)
    try:
        sorter.prepare()
    except CycleError as exc:
        cycle = exc.args[1]  # each phase must run before the next; the last is the first
        chain = " -> ".join(f"{n!r} ({owners.get(n, '?')})" for n in cycle)
        reasons = "; ".join(
            why.get((a, b), f"{b!r} runs after {a!r}") for a, b in itertools.pairwise(cycle)
        )
        raise PhaseOrderError(
            f"finalization phases form a cycle: {chain}, where each phase must run before "
            f"the next ({reasons})",
            plugins=[owners.get(n, "?") for n in cycle],
        ) from None
    ready: list[str] = list(sorter.get_ready())
    heapq.heapify(ready)
    order = []
    while ready:
        name = heapq.heappop(ready)
        order.append(phases[name])
        sorter.done(name)
        for nxt in sorter.get_ready():
            heapq.heappush(ready, nxt)
    return tuple(order)
