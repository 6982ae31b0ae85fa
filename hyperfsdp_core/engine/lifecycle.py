"""The state machines, as tables: a unit's hook states (:data:`TRANSITIONS`).

Every change of a unit's state goes through ``UnitState._transition`` against this table, so
re-entry (activation-checkpoint recomputation, several outputs, list units) is explicit and
idempotent rather than scattered over flags.
"""

from __future__ import annotations

import enum


class TrainingState(enum.Enum):
    IDLE = "IDLE"
    PRE_FORWARD = "PRE_FORWARD"
    FORWARD = "FORWARD"
    PRE_BACKWARD = "PRE_BACKWARD"
    BACKWARD = "BACKWARD"

    def __str__(self) -> str:
        return self.value


S = TrainingState
#: event -> {from state: to state}. A pair not listed is a bug and raises.
TRANSITIONS: dict[str, dict[TrainingState, TrainingState]] = {
    "forward_pre": {
        S.IDLE: S.PRE_FORWARD,
        S.FORWARD: S.PRE_FORWARD,  # reentrant recomputation, or a unit called twice
        S.BACKWARD: S.PRE_FORWARD,  # called again after its backward in one iteration
        S.PRE_FORWARD: S.PRE_FORWARD,  # next module of a list unit
        S.PRE_BACKWARD: S.PRE_BACKWARD,  # non-reentrant recomputation: idempotent
    },
    "forward_post": {
        S.PRE_FORWARD: S.FORWARD,
        S.PRE_BACKWARD: S.PRE_BACKWARD,  # non-reentrant recomputation: idempotent
    },
    "backward_pre": {
        S.FORWARD: S.PRE_BACKWARD,
        S.BACKWARD: S.PRE_BACKWARD,  # outputs of a second call of the unit
        S.PRE_FORWARD: S.PRE_BACKWARD,  # list unit whose forward is still open
        # a further backward through a graph the root drain already finished
        # (retain_graph=True: a second loss on one forward; or the graph a create_graph
        # backward built): re-gathers, and its gradients accumulate on the sharded ones
        S.IDLE: S.PRE_BACKWARD,
    },
    "post_backward": {
        S.PRE_BACKWARD: S.BACKWARD,
        S.FORWARD: S.BACKWARD,  # gradients reached the inputs without an output hook
        S.PRE_FORWARD: S.BACKWARD,  # list unit called piecewise (chunked loss)
        # not run in this backward: reached only to reduce unused params, or to reduce
        # gradients that arrived without the unit's hooks (FSDPModule.reduce_grads(), the
        # root drain after a create_graph graph reached the parameters directly)
        S.IDLE: S.BACKWARD,
        # post-backward already ran: FSDPModule.reduce_grads() (or the root drain after a
        # create_graph backward) reduces what arrived or was kept since
        S.BACKWARD: S.BACKWARD,
    },
}
# The root drain (and FSDPModule.reduce_grads() outside a backward) then returns every unit
# to IDLE from whatever state it finds (``UnitState._end_unit``).
