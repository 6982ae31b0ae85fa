"""Per-unit hook state machine: forward/backward hooks, lazy init, root finalization.

States (RFC section 3): ``IDLE -> PRE_FORWARD -> FORWARD -> PRE_BACKWARD -> BACKWARD``.
Every change goes through :meth:`UnitState._transition` against :data:`TRANSITIONS`,
so re-entry (activation-checkpoint recomputation, several outputs, list units)
is explicit and idempotent rather than scattered over flags.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..comm import Comm
from .port import PluginPort
from .root import RootContext, finish_reductions
from .spec import UnitSpec
from .stash import Stash
from .storage import announce_reset, rebuild_storage
from .unit_params import UnitParams


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


class RegisterPostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs the unit's post-backward."""

    @staticmethod
    def forward(ctx, state: UnitState, *inputs: torch.Tensor):  # type: ignore[override]
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        state = ctx.state
        root = state.ctx
        if root is not None and not root.in_backward:
            # No unit's output-gradient hook ran in this backward (a list unit's module
            # called on its own, e.g. a chunked loss's head): it still ends with the root
            # drain, so the gradients land on .grad when it returns, as in FSDP2.
            root.begin_backward()
        state.post_backward()
        return (None, *grads)


def _grad_tensors(tree: Any) -> tuple[list[Any], Any, list[int]]:
    leaves, spec = tree_flatten(tree)
    idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    return leaves, spec, idx


class UnitState:
    """One ``fully_shard`` call: its modules, parameter group, hooks and options."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: UnitParams | None,
        device: torch.device,
        reshard_after_forward: bool | int | None,
        port: PluginPort,
        *,
        mp_policy=None,
        offload_policy=None,
        unit_spec: UnitSpec | None = None,
        unit_fqns: tuple[str, ...] = (),
    ) -> None:
        self.modules = modules
        self.group = group
        self.device = device
        self.port = port  # the plugin layer: views and resolved hooks (``port``)
        self.stash = Stash()  # plugins' per-unit data (UnitView.stash)
        self.param_views = tuple(p.view for p in group.params) if group is not None else ()
        self.view = port.unit_view(self)
        self.ctx: RootContext | None = None
        self.is_root: bool | None = None
        self.fqn = ""
        self.training_state = S.IDLE
        # options (FSDPModule setters change them)
        self.auto_reshard_after_forward = reshard_after_forward is None
        self.reshard_after_forward: bool | int = (
            True if reshard_after_forward is None else reshard_after_forward
        )
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.reduce_scatter_unused_params = False
        self.unshard_in_backward = True
        self.forward_prefetch: list[UnitState] | None = None
        self.backward_prefetch: list[UnitState] | None = None
        self.max_reduce_buffers = 1
        # tree-wide settings: the root's values seed its context at lazy init; after it,
        # FSDPModule setters write the context (RootContext.is_last_backward, ...)
        self.is_last_backward = True
        self.post_optim_event = None
        self.mp_policy = mp_policy
        self.unit_spec = unit_spec  # fully_shard's options (no parameters)
        self.unit_fqns = unit_fqns  # group.params' FQNs relative to the unit
        self.offload_policy = offload_policy
        self.comm: Comm | None = None  # set at lazy init (or by share_comm_ctx)
        # resolved at lazy init from plugins
        self.input_transforms: tuple[Callable, ...] = ()
        self.output_transforms: tuple[Callable, ...] = ()
        self.reducers: tuple[Callable, ...] = ()
        # per iteration
        self.post_forward_indices: list[int] = []
        self.modules_to_run: set[nn.Module] = set()
        self.prefetched: bool = False
        self.deferred_prefetch = False  # the root's backward prefetch, see pre_backward
        self.can_defer_prefetch = False  # the root has a trainable parameter to defer to
        self.needs_reset = False  # a list unit's modules were converted (_apply)
        # The hooks run eagerly, outside any torch.compile'd region (a block compiled with
        # fullgraph=True calls its module hooks outside its graph): they issue async
        # collectives and swap the registered parameters, which dynamo cannot trace.
        self.forward_pre_hook = torch.compiler.disable(self.pre_forward)
        self.forward_post_hook = torch.compiler.disable(self.post_forward)
        self.backward_pre_hook = torch.compiler.disable(self.pre_backward)
        self.root_post_backward_hook = torch.compiler.disable(self.root_post_backward)
        for module in modules:
            module._hyperfsdp_state = self  # type: ignore[attr-defined]
            module.register_forward_pre_hook(self.forward_pre_hook, prepend=True, with_kwargs=True)
            module.register_forward_hook(self.forward_post_hook)

    # -- helpers ------------------------------------------------------------------------------

    def _transition(self, event: str) -> TrainingState:
        old = self.training_state
        try:
            new = TRANSITIONS[event][old]
        except KeyError:
            raise RuntimeError(
                f"hyperfsdp: unit {self.fqn or '<root>'!r} got {event!r} in state {old}; "
                "if a previous iteration raised, call reset_iter_state() on the root module"
            ) from None
        self.training_state = new
        ctx = self.ctx
        if ctx is not None and ctx.transition_log is not None:
            ctx.record(self.fqn, event, str(old), str(new))
        return new

    def _log(self, event: str) -> None:
        ctx = self.ctx
        if ctx is not None and ctx.transition_log is not None:
            ctx.record(self.fqn, event, str(self.training_state), str(self.training_state))

    # -- lazy init ----------------------------------------------------------------------------
    def lazy_init(self) -> RootContext:
        """At the first forward: this unit becomes the root of every unit below it."""
        if self.ctx is not None:
            return self.ctx
        if len(self.modules) != 1:
            raise RuntimeError(
                "hyperfsdp: the first forward must run through the root module, not a list "
                "unit; apply fully_shard to the model's top module last"
            )
        root_module = self.modules[0]
        states: list[UnitState] = []
        seen: set[int] = set()
        module_names: dict[int, list[str]] = {}
        for name, module in root_module.named_modules():
            state = getattr(module, "_hyperfsdp_state", None)
            if state is None:
                continue
            module_names.setdefault(id(state), []).append(name)
            if id(state) in seen:
                continue
            if state is not self and state.ctx is not None:
                raise RuntimeError(
                    f"hyperfsdp: unit {name!r} was already initialized as part of another root; "
                    "run the first forward through the top module"
                )
            seen.add(id(state))
            states.append(state)
        # a tied parameter is named as named_parameters() names it: by its first alias
        param_fqns = {id(p): n for n, p in root_module.named_parameters()}
        for state in states:
            group = state.group
            if group is None:
                continue
            for p in group.params:
                p.fqn = param_fqns.get(id(p.registered()), p.fqn)
            if state.needs_reset or any(
                p.registered() is not p.sharded_param for p in group.params
            ):
                # a list unit's modules converted since (to_empty, to), or
                # a parameter re-assigned since fully_shard (e.g. a DTensor computed from
                # the sharded one, or materialized from meta): train with it, as FSDP2 does
                state.needs_reset = False  # rebuilt here, not again at its pre-forward
                state.reset_sharded_params()
        check_materialized(states)
        comm = (
            self.comm if self.comm is not None and not self.comm.provisional else Comm(self.device)
        )
        ctx = RootContext(self, states, comm)
        for state in states:
            state.ctx = ctx
            state.is_root = state is self
            if state.comm is not None and state.comm is not comm:
                state.comm.trim()  # a private one from an unshard() before the first forward
            state.comm = comm
            state.fqn = ", ".join(module_names[id(state)])
        in_backward = ctx.backward_active
        for state in states:
            if state.group is not None:
                state.group.backward_active = in_backward
                state.prepare_group()
            forward = state.port.forward_hooks(state.view)
            state.input_transforms = forward.inputs
            state.output_transforms = forward.outputs
        if self.auto_reshard_after_forward:
            self.reshard_after_forward = False
        ctx.use_hooks(self.port.root_hooks(ctx.view))
        return ctx

    def prepare_group(self) -> None:
        """Per-unit plans built once the storage exists (lazy init, and after a rebuild):
        the unsharded parameters, the plugins' gradient reducers, the root's prefetch hook."""
        group = self.group
        assert group is not None
        group.name_unit(self.view, self.fqn)
        group.fill_input = self.port.all_gather_input(self.view)
        group.apply_settings()  # asks the unit's transport
        group.init_unsharded()
        hooks = self.port.gradient_hooks(self.view)
        self.reducers = hooks.reducers
        for p in group.params:
            p.land_grad = hooks.land_grad
        if self.is_root:
            # frozen parameters accumulate nothing (and cannot take the hook); an
            # all-gather extension's unsharded parameter is built at its first unshard
            trainable = [
                p.unsharded_param
                for p in group.params
                if p.requires_grad and p.unsharded_param is not None
            ]
            for param in trainable:
                param.register_post_accumulate_grad_hook(self._deferred_backward_prefetch)
            self.can_defer_prefetch = bool(trainable)

    def _deferred_backward_prefetch(self, param: torch.Tensor) -> None:
        if self.deferred_prefetch:
            self.deferred_prefetch = False
            self._backward_prefetch(self.ctx)

    # -- forward ------------------------------------------------------------------------------
    def ensure_storage(self) -> None:
        """Rebuild the sharded storage if a list unit's modules were converted since."""
        if self.needs_reset:
            self.needs_reset = False
            self.reset_sharded_params()

    def reset_sharded_params(self) -> None:
        """Rebuild the unit's storage around its registered parameters (see ``storage``)."""
        if rebuild_storage(self.group, self.unit_spec, self.unit_fqns, self.port) and self.ctx:
            self.prepare_group()
        announce_reset(self.group, self.port)

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.needs_reset:
            self.ensure_storage()
        ctx = self.ctx or self.lazy_init()
        if self.training_state is S.PRE_BACKWARD:
            # Non-reentrant recomputation inside backward: parameters stay unsharded.
            self._transition("forward_pre")
            if self.group is not None and not self.group.is_unsharded:
                self.group.unshard(self.comm)
                self.group.wait_for_unshard(self.comm)
            return self._transform_inputs(args, kwargs)
        if ctx.iter_forward_root is None and not ctx.in_backward:
            ctx.iter_forward_root = self
            args, kwargs = self._root_pre_forward(ctx, args, kwargs)
        first_in_pass = self.training_state is not S.PRE_FORWARD
        self._transition("forward_pre")
        self.prefetched = False
        if len(self.modules) > 1 and not self.modules_to_run:
            self.modules_to_run.update(self.modules)
        group = self.group
        if group is not None:
            group.unshard(self.comm)  # drops what it kept if an optimizer step made it stale
        if first_in_pass and not ctx.in_backward:
            self._forward_prefetch(ctx)  # overlaps the next unit's all-gather with our compute
        if group is not None:
            group.wait_for_unshard(self.comm)
        if first_in_pass and not ctx.in_backward:
            ctx.forward_order.append(self)
        if first_in_pass and group is not None and torch.is_grad_enabled():
            args, kwargs = self._register_post_backward(args, kwargs)
        return self._transform_inputs(args, kwargs)

    def _root_pre_forward(self, ctx: RootContext, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        event, ctx.post_optim_event = ctx.post_optim_event, None
        comm = ctx.comm
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
        comm.gathers_ordered = True
        # As FSDP2 does: move the forward's tensor inputs to the device.
        device = self.device

        def to_device(x):
            return (
                x.to(device, non_blocking=True)
                if isinstance(x, torch.Tensor) and x.device != device
                else x
            )

        return tree_map(to_device, args), tree_map(to_device, kwargs)

    def _forward_prefetch(self, ctx: RootContext) -> None:
        targets = self.forward_prefetch
        if targets is None:
            nxt = ctx.next_in_forward.get(self)
            targets = [nxt] if nxt is not None else ()
            group = nxt.group if nxt is not None else None
            if group is not None and group.is_sharded and not group.prefetch_overlaps(nxt.comm):
                # its gather runs in line when issued: gathered in its own pre-forward,
                # it is held for less time at no cost (and this forward still has an
                # unshard to take parked memory)
                return
        issued = False
        for target in targets:
            if target.group is not None and target.group.is_sharded:
                target.group.unshard(target.comm)
                target.prefetched = True
                issued = True
        if not issued:  # nothing left to gather in this forward: stop parking memory
            ctx.comm.stop_parking()

    def _transform_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for fn in self.input_transforms:
            args, kwargs = fn(args, kwargs)
        return args, kwargs

    def _transform_output(self, output: Any) -> Any:
        for fn in self.output_transforms:
            output = fn(output)
        return output

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            # the common case (positional tensors only) without a pytree round trip
            idx = [i for i, a in enumerate(args) if a.requires_grad]
            if not idx:
                return args, kwargs
            outs = RegisterPostBackward.apply(self, *(args[i] for i in idx))
            new = list(args)
            for i, t in zip(idx, outs):
                new[i] = t
            return tuple(new), kwargs
        leaves, spec, idx = _grad_tensors((args, kwargs))
        if not idx:
            return args, kwargs
        outs = RegisterPostBackward.apply(self, *(leaves[i] for i in idx))
        for i, t in zip(idx, outs):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        ctx = self.ctx
        assert ctx is not None
        if self.training_state is S.PRE_BACKWARD:
            self._transition("forward_post")
            return self._transform_output(output)
        if len(self.modules) > 1:
            self.modules_to_run.discard(module)
            if self.modules_to_run:  # the rest of the list unit has not run yet
                if ctx.iter_forward_root is self:  # claimed by a partial call: unordered
                    ctx.comm.gathers_ordered = False  # until the next root pre-forward
                return self._transform_output(output)
        self._complete_forward(ctx)
        output = self._register_pre_backward(output)
        if ctx.iter_forward_root is self:
            self._root_post_forward(ctx, output)
        return self._transform_output(output)

    def _complete_forward(self, ctx: RootContext) -> None:
        self._transition("forward_post")
        if self.group is not None and not ctx.in_backward:
            # a create_graph graph still reads the unsharded parameters: keep them
            raf = self.reshard_after_forward if not ctx.graph_holds_params else False
            if raf is True:
                self.group.reshard()
            else:
                if raf:  # an int: keep a share of the unsharded parameters in a smaller group
                    self.group.reshard_post_forward()
                # What stays held past the forward (the root's unsharded parameters, the
                # post-forward shard) is dropped before an optimizer step updates the
                # shards (``_held``): a forward that no backward follows (no_grad,
                # inference_mode, eval) leaves it held until then.
                self.group.hold()
            if torch.is_grad_enabled():  # a backward may follow: remember the order
                self.post_forward_indices.append(len(ctx.post_forward_order))
                ctx.post_forward_order.append(self)

    def _root_post_forward(self, ctx: RootContext, output: Any) -> None:
        for state in ctx.states:
            if state is self:
                continue
            if state.modules_to_run and state.training_state is S.PRE_FORWARD:
                # A list unit whose forward ran only some of its modules (e.g. norm but
                # not the chunked head): finish its forward now; its backward starts
                # when the root output's gradient arrives.
                state.modules_to_run.clear()
                state._complete_forward(ctx)
                state._register_pre_backward(output)
            elif state.prefetched:
                state.prefetched = False
                state.group.reshard()  # prefetched, but not run this iteration
        ctx.end_forward()

    def _register_pre_backward(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        if isinstance(output, torch.Tensor):  # the common case, without a pytree walk
            if output.requires_grad:
                output.register_hook(self.backward_pre_hook)
            return output
        leaves, _, idx = _grad_tensors(output)
        for i in idx:
            leaves[i].register_hook(self.backward_pre_hook)
        return output

    # -- backward -----------------------------------------------------------------------------
    def pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.training_state is S.PRE_BACKWARD:
            return grad
        ctx = self.ctx
        assert ctx is not None
        self._transition("backward_pre")
        ctx.begin_backward()
        group = self.group
        if group is not None and self.unshard_in_backward:
            group.unshard(self.comm)
        if self.is_root and self.backward_prefetch is None and self.can_defer_prefetch:
            # The root's backward (loss, output head) is where activation memory peaks:
            # prefetch once its first gradient is accumulated, past that peak.
            self.deferred_prefetch = True
        else:
            self._backward_prefetch(ctx)
        if group is not None and self.unshard_in_backward:
            group.wait_for_unshard(self.comm)
        return grad

    def _backward_prefetch(self, ctx: RootContext) -> None:
        targets = self.backward_prefetch
        if targets is None:
            if not self.post_forward_indices:
                return
            index = self.post_forward_indices.pop()
            if index == 0:
                return
            target = ctx.post_forward_order[index - 1]
            if target.group is not None and not target.group.prefetch_overlaps(target.comm):
                return  # gathered in line in its own pre-backward (see _forward_prefetch)
            targets = [target]
        for target in targets:
            # a unit whose backward already ran this pass (e.g. a stale entry from an
            # earlier microbatch) must not be gathered again: nothing would free it
            if (
                target.group is not None
                and target.unshard_in_backward
                and target is not self
                and target.training_state is not S.BACKWARD
            ):
                if not target.group.is_unsharded:  # parked memory would idle until then
                    ctx.comm.stop_parking()
                target.group.unshard(target.comm)

    def post_backward(self, force: bool = False) -> None:
        """Reduce this unit's gradients and reshard; idempotent within one backward.

        ``force`` (:func:`reduce_grads`, the root drain after a ``create_graph`` backward)
        also reduces gradients that arrived since the unit's post-backward, or without
        its hooks.
        """
        state = self.training_state
        group = self.group
        if not force:
            if state is S.BACKWARD:
                return
            if state is S.IDLE and not (group is not None and self.reduce_scatter_unused_params):
                return
        self._transition("post_backward")
        if group is None:
            return
        ctx = self.ctx
        assert ctx is not None
        if ctx.graph_live and not force:
            # a create_graph graph saved our unsharded parameters and may still add
            # gradients to them later in this backward: the root drain reduces and reshards
            return
        self._reduce(ctx, reshard=not ctx.graph_holds_params)

    def _reduce(self, ctx: RootContext, reshard: bool) -> None:
        group = self.group
        assert group is not None
        if ctx.creates_graph:
            self._check_grads_not_differentiable()
        # Free the unsharded parameters first (their gradients are separate tensors), so
        # they are not held while the reduce-scatter buffers are allocated.
        if reshard and self.reshard_after_backward:
            group.reshard()
        if self.requires_gradient_sync:
            # RFC 6.3: wait for the earlier units' reduce-scatters (at most
            # max_reduce_buffers - 1 stay in flight), issue ours, and only then finish the
            # earlier ones: their reducers' data-parallel all-reduces are issued after our
            # reduce-scatter, never queued ahead of it.
            earlier = ctx.wait_reductions(keep=self.max_reduce_buffers - 1)
            reductions = group.reduce(self.comm, include_unused=self.reduce_scatter_unused_params)
            if reductions:
                ctx.add_reductions(self, reductions)
            for state, reds in earlier:
                finish_reductions(state, reds, ctx.comm)
        else:
            group.keep_grads()

    def _check_grads_not_differentiable(self) -> None:
        for p in self.group.params:
            grad = p.unsharded_param.grad if p.unsharded_param is not None else None
            if grad is not None and grad.requires_grad:
                raise RuntimeError(
                    f"hyperfsdp: backward(create_graph=True) gave parameter {p.fqn!r} (unit "
                    f"{self.fqn or '<root>'!r}) a differentiable gradient; a sharded gradient is "
                    "reduced across ranks, which autograd cannot differentiate, so higher-order "
                    "gradients through parameter gradients are not supported. For a gradient "
                    "penalty, differentiate with respect to activations instead: "
                    "torch.autograd.grad(out, inputs, create_graph=True)"
                )

    def root_post_backward(self) -> None:
        """End-of-backward callback of the root: finish every unit, then run the phases.

        It drains unconditionally (RFC 3.1, 6.2): after every backward, whatever
        ``set_is_last_backward`` says, every reduction launched in it has been applied
        and every unit is back to IDLE.
        """
        ctx = self.ctx
        assert ctx is not None
        states = ctx.states
        logging_on = ctx.transition_log is not None
        if logging_on:
            for state in states:
                state._log("root_backward_enter")
        try:
            force = ctx.graph_live  # reductions were deferred to here (see post_backward)
            for state in reversed(states):
                state.post_backward(force)
            ctx.run_phases()
        finally:  # even if a phase raised, the next iteration starts from IDLE
            self._end_iteration(ctx, logging_on)

    def _end_iteration(self, ctx: RootContext, logging_on: bool) -> None:
        keep_unsharded = ctx.graph_holds_params
        for state in ctx.states:
            if logging_on:
                state._log("root_backward_exit")
            state._end_unit(keep_unsharded)
        ctx.end_backward(ctx.is_last_backward)

    def _end_unit(self, keep_unsharded: bool = False) -> None:
        self.training_state = S.IDLE
        self.modules_to_run.clear()
        self.deferred_prefetch = False
        group = self.group
        if group is not None:
            if group.has_pending or (self.reshard_after_backward and not keep_unsharded):
                group.reshard()  # also drops prefetched gathers nobody consumed
            elif group.is_unsharded:
                group.hold()  # kept: dropped before an optimizer steps

    # -- recovery -----------------------------------------------------------------------------
    def reset_iter_state(self) -> None:
        ctx = self.ctx
        if ctx is None:
            return
        if not self.is_root:
            raise RuntimeError("reset_iter_state() must be called on the root module")
        ctx.reset()
        for state in ctx.states:
            state.training_state = S.IDLE
            state.modules_to_run.clear()
            state.prefetched = False
            if state.group is not None:
                state.group.reshard()
                for p in state.group.params:
                    p.clear_iteration_grads()


def check_materialized(states: list[UnitState]) -> None:
    """Fail a forward whose units still have parameters on the meta device, naming them."""
    on_meta = [
        p.fqn
        for state in states
        if state.group is not None
        for b in state.group.buckets
        if b.sharded_flat is not None and b.sharded_flat.is_meta
        for p in b.params
    ]
    if on_meta:
        raise RuntimeError(
            f"hyperfsdp: {len(on_meta)} sharded parameter(s) are still on the meta device at "
            f"the first forward: {', '.join(on_meta)}. Materialize them before training: "
            "model.to_empty(device=...) allocates every shard on a real device, then "
            "initialize the values (e.g. call reset_parameters() on each module, or load a "
            "checkpoint)"
        )


def reduce_grads(states: list[UnitState]) -> None:
    """Reduce what ``states`` hold now (``FSDPModule.reduce_grads``); see its docstring."""
    ctx = states[0].ctx
    if ctx is None:  # before the first forward no unit can hold a gradient
        return
    saved = [(s, s.requires_gradient_sync, s.requires_all_reduce) for s in states]
    try:
        # the explicit request to synchronise: reduce over the whole data-parallel group
        for s in states:
            s.requires_gradient_sync = s.requires_all_reduce = True
        for s in reversed(states):
            s.post_backward(force=True)
        ctx.run_phases()
    finally:
        for s, sync, all_reduce in saved:
            s.requires_gradient_sync, s.requires_all_reduce = sync, all_reduce
    if not ctx.in_backward:  # inside a backward, the root drain ends the iteration
        keep_unsharded = ctx.graph_holds_params
        for s in states:
            s._end_unit(keep_unsharded)
