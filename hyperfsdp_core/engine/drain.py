"""The end of a root's backward: every unit finished, the finalization phases run, and the
explicit reduction ``FSDPModule.reduce_grads`` (pipeline schedules) built from the same steps."""

from __future__ import annotations

from .root import RootContext, Unit


def drain(ctx: RootContext) -> None:
    """End-of-backward callback of a root: finish every unit, then run the phases.

    It drains unconditionally (RFC 3.1, 6.2): after every backward, whatever
    ``set_is_last_backward`` says, every reduction launched in it has been applied
    and every unit is back to IDLE.
    """
    states = ctx.states
    logging_on = ctx.transition_log is not None
    if logging_on:
        for state in states:
            state.log("root_backward_enter")
    try:
        force = ctx.graph_live  # reductions were deferred to here (see post_backward)
        for state in reversed(states):
            state.post_backward(force)
        ctx.run_phases()
    finally:  # even if a phase raised, the next iteration starts from IDLE
        keep_unsharded = ctx.graph_holds_params
        for state in states:
            if logging_on:
                state.log("root_backward_exit")
            state.end_unit(keep_unsharded)
        ctx.end_backward(ctx.is_last_backward)


def reduce_grads(states: list[Unit]) -> None:
    """Reduce what ``states`` hold now (``FSDPModule.reduce_grads``); see its docstring."""
    ctx = states[0].ctx
    if ctx is None:  # before the first forward no unit can hold a gradient
        return
    saved = [(s, s.options) for s in states]
    try:
        # the explicit request to synchronise: reduce over the whole data-parallel group
        for s in states:
            s.set_options(requires_gradient_sync=True, requires_all_reduce=True)
        for s in reversed(states):
            s.post_backward(force=True)
        ctx.run_phases()
    finally:
        for s, options in saved:
            s.restore_options(options)
    if not ctx.in_backward:  # inside a backward, the root drain ends the iteration
        keep_unsharded = ctx.graph_holds_params
        for s in states:
            s.end_unit(keep_unsharded)
