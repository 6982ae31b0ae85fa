"""RootContext: everything per-iteration that one root and its units share.

There is no class-level or module-global per-iteration state: two models in one
process have two contexts and never see each other's queues.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import TYPE_CHECKING

from ._collectives import Comm, PluginComm
from ._stash import Stash
from ._torch_private import queue_end_of_backward_callback
from ._views import RootView

if TYPE_CHECKING:
    from ._reduction import Reduction
    from ._state import FSDPState

#: Set to a non-empty value to log every unit's state transitions (logger below, INFO).
LOG_TRANSITIONS_ENV = "HYPERFSDP_LOG_TRANSITIONS"
transition_logger = logging.getLogger("hyperfsdp_core.transitions")


class RootContext:
    """Shared by all units under one root; created at the root's lazy init."""

    def __init__(self, root: FSDPState, states: list[FSDPState], comm: Comm) -> None:
        self.root = root
        self.states = states
        self.unit_views = tuple(s.view for s in states)
        self.comm = comm
        self.plugin_comm = PluginComm(comm)
        self.view = RootView(self)
        self.finalize_runs: tuple = ()
        #: Plugins' per-root data (queues, groups), under their own StashKeys.
        self.stash = Stash()
        # per iteration
        self.iter_forward_root: FSDPState | None = None
        self.in_backward = False
        self.callback_queued = False
        self.post_forward_order: list[FSDPState] = []
        self.forward_order: list[FSDPState] = []
        self.next_in_forward: dict[FSDPState, FSDPState] = {}
        # one entry per unit post-backward that reduced: (unit, its reductions)
        self.pending_reductions: list[tuple[FSDPState, list[Reduction]]] = []
        # transition log: None when off (the common case costs one attribute test)
        self.transition_log: list[tuple[str, str, str, str]] | None = None
        if os.environ.get(LOG_TRANSITIONS_ENV):
            self.enable_transition_log()

    def set_comm(self, comm: Comm) -> None:
        """Use ``comm`` for every unit of this root (``share_comm_ctx``)."""
        comm.observers.extend(o for o in self.comm.observers if o not in comm.observers)
        self.comm = comm
        self.plugin_comm = PluginComm(comm)
        for state in self.states:
            state.comm = comm

    # -- transition log ---------------------------------------------------------------------
    def enable_transition_log(self) -> list[tuple[str, str, str, str]]:
        """Start recording ``(unit_fqn, event, from_state, to_state)``; returns the list."""
        if self.transition_log is None:
            self.transition_log = []
        if os.environ.get(LOG_TRANSITIONS_ENV):
            if not transition_logger.isEnabledFor(logging.INFO):
                transition_logger.setLevel(logging.INFO)
            if not transition_logger.hasHandlers():
                transition_logger.addHandler(logging.StreamHandler())
        return self.transition_log

    def record(self, fqn: str, event: str, old: str, new: str) -> None:
        assert self.transition_log is not None
        self.transition_log.append((fqn, event, old, new))
        transition_logger.info("%s %s: %s -> %s", fqn or "<root>", event, old, new)

    # -- forward ------------------------------------------------------------------------------
    def end_forward(self) -> None:
        """The iteration's forward root finished its forward."""
        # Communication buffers are reused within a pass (units of one pass mostly share
        # sizes); none is kept idle across the activation peak or the optimizer step.
        self.comm.trim()
        if self.forward_order:
            order = self.forward_order
            self.next_in_forward = {a: b for a, b in itertools.pairwise(order) if a is not b}
            self.forward_order = []
        self.iter_forward_root = None

    # -- backward -------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self.in_backward = True
        if not self.callback_queued:
            self.callback_queued = True
            queue_end_of_backward_callback(self.root.root_post_backward)

    def add_reductions(self, state: FSDPState, reductions: list[Reduction]) -> None:
        self.pending_reductions.append((state, reductions))

    def drain_reductions(self, keep: int = 0) -> None:
        """Finish pending post-backward reductions, oldest first, until ``keep`` remain."""
        pending = self.pending_reductions
        while len(pending) > keep:
            state, reductions = pending.pop(0)
            finish_reductions(state, reductions, self.comm)

    def end_backward(self, is_last_backward: bool) -> None:
        self.comm.trim()
        self.in_backward = False
        self.callback_queued = False
        # a standalone call of a list unit's module (a chunked-loss head) claims the
        # forward root without finishing it; the next forward starts fresh
        self.iter_forward_root = None
        if is_last_backward:
            self.post_forward_order.clear()
            for state in self.states:
                state.post_forward_indices.clear()

    def reset(self) -> None:
        """Forget the current iteration (after an exception); in-flight reductions are dropped.

        Plugins' per-root objects in ``stash`` that have a ``reset()`` method are reset too
        (e.g. the hsdp plugin drops its in-flight all-reduces and partial sums).
        """
        for _, reductions in self.pending_reductions:
            for red in reductions:
                red._abandon()
        for value in self.stash.values():
            reset = getattr(value, "reset", None)
            if callable(reset):
                reset()
        self.pending_reductions = []
        self.iter_forward_root = None
        self.in_backward = False
        self.callback_queued = False
        self.post_forward_order.clear()
        self.forward_order = []
        for state in self.states:
            state.post_forward_indices.clear()


def finish_reductions(state: FSDPState, reductions: list[Reduction], comm: Comm) -> None:
    """Wait for one post-backward's reductions, run the unit's reducers, then release the
    core's hold: what no reducer deferred or consumed lands on ``.grad`` now."""
    for red in reductions:
        red._wait(comm)
    for reducer in state.reducers:
        reducer(reductions)
    for red in reductions:
        red.release()
