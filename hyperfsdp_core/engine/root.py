"""RootContext: everything per-iteration that one root and its units share.

There is no class-level or module-global per-iteration state: two models in one
process have two contexts and never see each other's queues.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from .._torch_private import queue_end_of_backward_callback, tree_map
from ..comm import Comm, PluginComm
from .lifecycle import BACKWARD_TRANSITIONS, BackwardState
from .options import UnitOptions
from .port import PluginPort, RootHooks
from .stash import Stash

if TYPE_CHECKING:
    from .reduction import Reduction
    from .unit_params import UnitParams

#: Set to a non-empty value to log every unit's state transitions (logger below, INFO).
LOG_TRANSITIONS_ENV = "HYPERFSDP_LOG_TRANSITIONS"
transition_logger = logging.getLogger("hyperfsdp_core.transitions")

#: Settings of the whole tree of units under a root (``UnitState.set_tree_setting``).
TREE_SETTINGS = ("is_last_backward", "post_optim_event")


class Unit(Protocol):
    """A unit of a root, as the root and the modules that handle units for it (``drain``,
    ``lazy_init``) use it: ``engine.state.UnitState``, which imports them."""

    fqn: str
    device: torch.device
    modules: tuple[nn.Module, ...]
    group: UnitParams | None
    port: PluginPort
    view: Any
    comm: Comm | None
    ctx: RootContext | None
    options: UnitOptions
    reducers: tuple[Callable, ...]
    post_forward_indices: list[int]
    is_last_backward: bool
    post_optim_event: Any
    root_post_backward_hook: Callable[[], None]

    def use_comm(self, comm: Comm) -> None: ...
    def adopt_registered_params(self, param_fqns: dict[int, str]) -> None: ...
    def join_root(self, ctx: RootContext, fqn: str) -> None: ...
    def prepare_for_root(self) -> None: ...
    def post_backward(self, force: bool = False) -> None: ...
    def end_unit(self, keep_unsharded: bool = False) -> None: ...
    def log(self, event: str) -> None: ...
    def set_options(self, **changes: Any) -> None: ...
    def restore_options(self, options: UnitOptions) -> None: ...


class RootContext:
    """Shared by all units under one root; created at the root's lazy init."""

    def __init__(self, root: Unit, states: list[Unit], comm: Comm) -> None:
        self.root = root
        self.states = states
        self.unit_views = tuple(s.view for s in states)
        self.comm = comm
        self.plugin_comm = PluginComm(comm)
        self.view = root.port.root_view(self)  # what phases and observers are handed
        self._resolve_transports()
        self.finalize_runs: tuple = ()  # see use_hooks
        #: Plugins' per-root data (queues, groups), under their own StashKeys.
        self.stash = Stash()
        # tree-wide settings (FSDPModule setters write them here, whichever unit they are
        # called on): seeded from the root's values at lazy init
        self.is_last_backward: bool = root.is_last_backward
        self.post_optim_event = root.post_optim_event
        # per iteration
        self.iter_forward_root: Unit | None = None
        # the backwards (lifecycle.BackwardState): a create_graph backward saves the
        # units' unsharded parameters in the graph it builds; they stay allocated, and
        # reductions wait for the root drain, until a backward that builds no graph has
        # consumed it (see ``_enter_graph_mode``)
        self.backward = BackwardState.NONE
        self._graph_hooks: list[Any] = []
        self.post_forward_order: list[Unit] = []
        self.forward_order: list[Unit] = []
        self.next_in_forward: dict[Unit, Unit] = {}
        # one entry per unit post-backward that reduced: (unit, its reductions)
        self.pending_reductions: list[tuple[Unit, list[Reduction]]] = []
        # transition log: None when off (the common case costs one attribute test)
        self.transition_log: list[tuple[str, str, str, str]] | None = None
        if os.environ.get(LOG_TRANSITIONS_ENV):
            self.enable_transition_log()

    def _resolve_transports(self) -> None:
        """Give each unit the question for its transport (``hyperfsdp_transport``), asked
        when its settings are applied at lazy init (``prepare_group``, once its fqn is
        known); the comm looks a unit's up by fqn for the collectives plugins issue with
        ``unit=<fqn>``."""
        pairs = []
        for state in self.states:
            if state.group is not None:
                state.group.ask_transport(state.port.transport_question(state.view))
                pairs.append((state.view, state.group))
        self._unit_transports = pairs
        self.comm.add_unit_transports(pairs)

    def set_tree_setting(self, name: str, value: Any) -> None:
        assert name in TREE_SETTINGS
        setattr(self, name, value)

    def use_hooks(self, hooks: RootHooks) -> None:
        """The root's resolved plugin hooks: finalization phases and collective observers."""
        self.finalize_runs = hooks.finalize_runs
        self.comm.observers.extend(hooks.observers)

    def set_comm(self, comm: Comm) -> None:
        """Use ``comm`` for every unit of this root (``share_comm_ctx``)."""
        comm.observers.extend(o for o in self.comm.observers if o not in comm.observers)
        old, self.comm = self.comm, comm
        comm.add_unit_transports(self._unit_transports)
        self.plugin_comm = PluginComm(comm)
        for state in self.states:
            state.use_comm(comm)
        if old is not comm:
            old.trim()  # its idle buffers

    def run_phases(self) -> None:
        """Run the finalization phases in their resolved order (logged when logging is on)."""
        logging_on = self.transition_log is not None
        for name, run in self.finalize_runs:
            if logging_on:
                self.record(self.root.fqn, "phase", name, name)
            run(self.view)

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
    def begin_forward(self, root: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``root`` (a unit) starts this iteration's forward: the optimizer step is ordered
        before its all-gathers; its tensor inputs move to the device, as FSDP2 does."""
        self.iter_forward_root = root
        event, self.post_optim_event = self.post_optim_event, None
        comm = self.comm
        if comm.is_cpu:
            comm.resume_parking()  # this forward's reshards park their memory
            return args, kwargs
        # The optimizer step must finish before all-gathers read the sharded params: with
        # ``set_post_optim_event``, only the work before that event. This forward's
        # all-gathers into fresh memory then wait for nothing else (``gathers_ordered``).
        if event is not None:
            comm.all_gather_stream.wait_event(event)
        else:
            comm.all_gather_stream.wait_stream(comm.current_stream())
        comm.order_gathers(True)
        # As FSDP2 does: move the forward's tensor inputs to the device.
        device = root.device

        def to_device(x):
            return (
                x.to(device, non_blocking=True)
                if isinstance(x, torch.Tensor) and x.device != device
                else x
            )

        return tree_map(to_device, args), tree_map(to_device, kwargs)

    def end_forward(self) -> None:
        """The iteration's forward root finished its forward."""
        # Communication buffers are reused within a pass (units of one pass mostly share
        # sizes); none is kept idle across the activation peak or the optimizer step.
        self.comm.trim()
        # Backward reshards park until a backward prefetch is issued (``_backward_prefetch``
        # stops it): a prefetch is issued before the unit after it reshards, so parked
        # memory would idle through a whole gradient computation (param-heavy: +19 MiB at
        # the heap peak, no time gained). Gathers that run in line are not prefetched:
        # a unit's reshard parks, its reduce-scatter input takes that memory, and the
        # next unit's unshard takes it back, one buffer handed along the backward.
        self.comm.resume_parking(max_idle=1)
        if self.forward_order:
            order = self.forward_order
            self.next_in_forward = {a: b for a, b in itertools.pairwise(order) if a is not b}
            self.forward_order = []
        self.iter_forward_root = None
        self.comm.order_gathers(False)  # until the backward (or the next forward)

    # -- backward -------------------------------------------------------------------------------
    @property
    def in_backward(self) -> bool:
        """Whether a backward of this root is running (units' held parameters in use)."""
        state = self.backward
        return state is not BackwardState.NONE and state is not BackwardState.GRAPH_HELD

    @property
    def creates_graph(self) -> bool:
        """The running backward has ``create_graph=True`` (grad mode on in its hooks)."""
        return self.backward is BackwardState.BUILDING_GRAPH

    @property
    def graph_live(self) -> bool:
        """A graph a create_graph backward built exists and no backward consumed it yet."""
        state = self.backward
        return state is not BackwardState.NONE and state is not BackwardState.RUNNING

    @property
    def graph_holds_params(self) -> bool:
        """A create_graph graph may still read the unsharded parameters: the backward that
        builds it is running, or it has run and no backward has consumed it yet."""
        state = self.backward
        return state is BackwardState.BUILDING_GRAPH or state is BackwardState.GRAPH_HELD

    def _move_backward(self, event: str) -> None:
        try:
            self.backward = BACKWARD_TRANSITIONS[event][self.backward]
        except KeyError:
            raise RuntimeError(
                f"hyperfsdp: the root's backward got {event!r} in state {self.backward}; if a "
                "previous iteration raised, call reset_iter_state() on the root module"
            ) from None

    def begin_backward(self) -> None:
        """A unit's backward hook ran: the root's backward begins (once per backward)."""
        if self.in_backward:
            return
        # the sharded parameters are as the forward read them (ordered after the
        # optimizer step by then): backward all-gathers into fresh memory wait for
        # nothing else
        self.comm.order_gathers(True)
        queue_end_of_backward_callback(self.root.root_post_backward_hook)
        # hooks run in autograd's grad mode, which is on exactly with create_graph=True
        if not torch.is_grad_enabled():
            self._move_backward("begin")
            return
        hooked = self.graph_live  # a graph is held already: its hooks are registered
        self._move_backward("begin_creating_graph")
        if not hooked:
            self._enter_graph_mode()

    # -- higher-order gradients -----------------------------------------------------------------
    def _enter_graph_mode(self) -> None:
        """A backward builds a graph (``create_graph=True``) that saved unsharded parameters.

        Until a later backward consumes that graph, the parameters stay allocated, and
        every gradient that lands on them starts the root drain even when no unit's
        output-gradient hook runs (a gradient penalty's graph reaches the parameters
        directly): each unsharded parameter that requires grad gets a hook, removed again
        in :meth:`_leave_graph_mode`. Only this rare path pays for the hooks.
        """
        for state in self.states:
            if state.group is None:
                continue
            for p in state.group.params:
                param = p.unsharded_param
                if param is not None and param.requires_grad:
                    self._graph_hooks.append(
                        param.register_post_accumulate_grad_hook(self._grad_in_graph)
                    )

    def _grad_in_graph(self, param: torch.Tensor) -> None:
        if not self.in_backward:
            self.begin_backward()

    def _leave_graph_mode(self) -> None:
        for handle in self._graph_hooks:
            handle.remove()
        self._graph_hooks = []

    def add_reductions(self, state: Unit, reductions: list[Reduction]) -> None:
        self.pending_reductions.append((state, reductions))

    def drain_reductions(self, keep: int = 0) -> None:
        """Finish pending post-backward reductions, oldest first, until ``keep`` remain."""
        pending = self.pending_reductions
        while len(pending) > keep:
            state, reductions = pending.pop(0)
            finish_reductions(state, reductions, self.comm)

    def wait_reductions(self, keep: int) -> list[tuple[Unit, list[Reduction]]]:
        """Take the oldest pending reductions until ``keep`` remain, their collectives
        complete (buffers recycled); the caller finishes them with :func:`finish_reductions`."""
        pending = self.pending_reductions
        taken = []
        while len(pending) > keep:
            entry = pending.pop(0)
            for red in entry[1]:
                red._wait(self.comm)
            taken.append(entry)
        return taken

    def end_backward(self, is_last_backward: bool) -> None:
        self.comm.trim()
        if self.backward is BackwardState.CONSUMING_GRAPH:
            self._leave_graph_mode()  # this backward consumed the graph
        self._move_backward("end")
        # a standalone call of a list unit's module (a chunked-loss head) claims the
        # forward root without finishing it; the next forward starts fresh
        self.iter_forward_root = None
        self.comm.order_gathers(False)  # an optimizer step may come next
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
        self.comm.order_gathers(False)
        self.backward = BackwardState.NONE
        self._leave_graph_mode()
        self.post_forward_order.clear()
        self.forward_order = []
        for state in self.states:
            state.post_forward_indices.clear()


def finish_reductions(state: Unit, reductions: list[Reduction], comm: Comm) -> None:
    """Wait for one post-backward's reductions, run the unit's reducers, then release the
    core's hold: what no reducer deferred or consumed lands on ``.grad`` now."""
    for red in reductions:
        red._wait(comm)
    for reducer in state.reducers:
        reducer(reductions)
    for red in reductions:
        red.release()
