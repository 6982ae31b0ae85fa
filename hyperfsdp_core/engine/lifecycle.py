"""The state machines, as tables: a unit's hook states (:data:`TRANSITIONS`), a bucket's
parameters (:data:`BUCKET_TRANSITIONS`) and a root's backwards (:data:`BACKWARD_TRANSITIONS`).

Every hook event of a unit goes through ``UnitState._transition`` (logged when the root's
transition log is on), and every change of a bucket's state through ``Bucket._move``, against
these tables: re-entry (activation-checkpoint recomputation, several outputs, list units,
prefetches nobody consumed) is explicit and a pair not listed raises, rather than being
scattered over flags. The two ways back to ``IDLE`` are not events of the table: the end of a
unit's iteration (``UnitState.end_unit``, from the root's drain) and
``UnitState.reset_iter_state`` set it from whatever state they find, unlogged.
"""

from __future__ import annotations

import enum


class _State(enum.Enum):
    """A state of one of the machines below; prints as its value."""

    def __str__(self) -> str:
        return self.value


class TrainingState(_State):
    IDLE = "IDLE"
    PRE_FORWARD = "PRE_FORWARD"
    FORWARD = "FORWARD"
    PRE_BACKWARD = "PRE_BACKWARD"
    BACKWARD = "BACKWARD"


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
# to IDLE from whatever state it finds (``UnitState.end_unit``).


class BucketState(_State):
    """Which parameters a bucket has registered, and what it holds (``engine/bucket.py``)."""

    #: the sharded DTensors; only the sharded storage is held
    SHARDED = "sharded"
    #: ``reshard_after_forward=<int>``: the post-forward DTensors over the smaller group,
    #: their shard held until backward gathers from it
    POST_FORWARD = "post_forward"
    #: an all-gather issued from the sharded storage, not waited for yet (sharded registered)
    GATHERING = "gathering"
    #: an all-gather issued from the post-forward shard (post-forward DTensors registered)
    GATHERING_FROM_POST_FORWARD = "gathering_from_post_forward"
    #: the unsharded parameters registered, their memory held
    UNSHARDED = "unsharded"


B = BucketState
_ANY_TO_SHARDED = {state: B.SHARDED for state in B}
#: event -> {from state: to state}. A pair not listed is a bug and raises.
BUCKET_TRANSITIONS: dict[str, dict[BucketState, BucketState]] = {
    # start_unshard (a local cast or copy completes at once, but still passes GATHERING)
    "unshard": {B.SHARDED: B.GATHERING, B.POST_FORWARD: B.GATHERING_FROM_POST_FORWARD},
    # finish_unshard: waited, copied out, the unsharded parameters registered
    "gathered": {B.GATHERING: B.UNSHARDED, B.GATHERING_FROM_POST_FORWARD: B.UNSHARDED},
    # reshard_post_forward: keep the chunks over the smaller group for backward
    "reshard_post_forward": {B.UNSHARDED: B.POST_FORWARD},
    # reshard: from anywhere (a prefetch nobody waited for is abandoned)
    "reshard": _ANY_TO_SHARDED,
    # build_sharded: new sharded storage (load, to(), to_empty())
    "rebuild": _ANY_TO_SHARDED,
}


class BackwardState(_State):
    """Where a root stands with its backwards (``RootContext.backward``), including a graph
    a ``create_graph=True`` backward built, which saved the units' unsharded parameters."""

    #: no backward runs, and no graph holds the unsharded parameters
    NONE = "none"
    #: a backward runs that builds no graph
    RUNNING = "running"
    #: a backward with ``create_graph=True`` runs: its graph saves the unsharded parameters
    BUILDING_GRAPH = "building_graph"
    #: between backwards: the graph built may still read the unsharded parameters
    GRAPH_HELD = "graph_held"
    #: a backward through that graph runs, building none: it consumes the graph
    CONSUMING_GRAPH = "consuming_graph"


G = BackwardState
#: event -> {from state: to state} (``RootContext.begin_backward``/``end_backward``); the
#: root's ``reset`` returns to ``NONE`` from anywhere.
BACKWARD_TRANSITIONS: dict[str, dict[BackwardState, BackwardState]] = {
    "begin": {G.NONE: G.RUNNING, G.GRAPH_HELD: G.CONSUMING_GRAPH},
    "begin_creating_graph": {G.NONE: G.BUILDING_GRAPH, G.GRAPH_HELD: G.BUILDING_GRAPH},
    "end": {
        G.RUNNING: G.NONE,
        G.CONSUMING_GRAPH: G.NONE,
        G.BUILDING_GRAPH: G.GRAPH_HELD,
        G.NONE: G.NONE,  # reset_iter_state() ran during the backward
    },
}
