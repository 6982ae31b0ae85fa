"""One unit's hooks: the forward and backward hooks of a ``fully_shard`` call, driving its
parameters through the state machine of ``lifecycle.py`` (RFC section 3:
``IDLE -> PRE_FORWARD -> FORWARD -> PRE_BACKWARD -> BACKWARD``): unshard (with prefetch)
and reshard around the forward; in backward, unshard again, reduce the gradients once per
backward, reshard. A root's lazy init is in ``lazy_init.py``, its end-of-backward drain
in ``drain.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from ..comm import Comm
from .autograd import register_post_backward, register_pre_backward
from .drain import drain
from .lazy_init import init_root
from .lifecycle import TRANSITIONS, TrainingState
from .options import UnitOptions
from .port import PluginPort
from .root import TREE_SETTINGS, RootContext, finish_reductions
from .stash import Stash
from .storage import announce_reset, rebuild_storage
from .unit_params import UnitParams

S = TrainingState


class UnitState:
    """One ``fully_shard`` call: its modules, parameter group, hooks and options."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: UnitParams | None,
        device: torch.device,
        options: UnitOptions,
        port: PluginPort,
    ) -> None:
        self.modules = modules
        self.group = group
        self.device = device
        self.options = options  # replaced, never changed (set_options)
        self.port = port  # the plugin layer: views and resolved hooks (``port``)
        self.stash = Stash()  # plugins' per-unit data (UnitView.stash)
        self.param_views = tuple(p.view for p in group.params) if group is not None else ()
        self.view = port.unit_view(self)
        self.ctx: RootContext | None = None
        self.is_root: bool | None = None
        self.fqn = ""
        self.training_state = S.IDLE
        # tree-wide settings: the root's values seed its context at lazy init; after it,
        # FSDPModule setters write the context (RootContext.is_last_backward, ...)
        self.is_last_backward = True
        self.post_optim_event = None
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

    def log(self, event: str) -> None:
        ctx = self.ctx
        if ctx is not None and ctx.transition_log is not None:
            ctx.record(self.fqn, event, str(self.training_state), str(self.training_state))

    # -- lazy init (``lazy_init.py``) -------------------------------------------------------------
    def lazy_init(self) -> RootContext:
        """At the first forward: this unit becomes the root of every unit below it."""
        return self.ctx if self.ctx is not None else init_root(self)

    def adopt_registered_params(self, param_fqns: dict[int, str]) -> None:
        """Name the parameters as the root names them; train with what is registered now (a
        list unit's modules converted since, or a parameter re-assigned since fully_shard,
        e.g. a DTensor computed from the sharded one, or materialized from meta), as FSDP2."""
        group = self.group
        if group is None:
            return
        for p in group.params:
            p.rename(param_fqns.get(id(p.registered()), p.fqn))
        if self.needs_reset or any(p.registered() is not p.sharded_param for p in group.params):
            self.needs_reset = False  # rebuilt here, not again at its pre-forward
            self.reset_sharded_params()

    def join_root(self, ctx: RootContext, fqn: str) -> None:
        """Become a unit of ``ctx``'s root, named ``fqn`` (its module names in the root)."""
        self.ctx = ctx
        self.is_root = ctx.root is self
        if self.comm is not None and self.comm is not ctx.comm:
            self.comm.trim()  # a private one from an unshard() before the first forward
        self.comm = ctx.comm
        self.fqn = fqn

    def prepare_for_root(self) -> None:
        """Plans and resolved hooks, once every unit of the root has joined it."""
        if self.group is not None:
            self.group.join_root(self.ctx)
            self.prepare_group()
        forward = self.port.forward_hooks(self.view)
        self.input_transforms = forward.inputs
        self.output_transforms = forward.outputs
        if self.is_root and self.options.auto_reshard_after_forward:
            self.set_options(reshard_after_forward=False)  # the root keeps its parameters

    def reset_before_forward(self) -> None:
        """A list unit's modules were converted (``_apply``): its sharded parameters are
        rebuilt at its next pre-forward, once every module of the list is."""
        self.needs_reset = True

    def use_comm(self, comm: Comm) -> None:
        """Communicate through ``comm`` from now on (``share_comm_ctx``); reshards park
        memory with it."""
        self.comm = comm
        if self.group is not None:
            for bucket in self.group.buckets:
                bucket.use_storage_pool(comm.storage_pool)

    def set_options(self, **changes: Any) -> None:
        """Change options (``FSDPModule`` setters): a new record, the old one untouched."""
        self.options = attrs.evolve(self.options, **changes)

    def restore_options(self, options: UnitOptions) -> None:
        self.options = options

    def set_tree_setting(self, name: str, value: Any) -> None:
        """A tree-wide setting (``is_last_backward``, ``post_optim_event``): the root's
        context's after lazy init (a call on any unit acts on the whole tree, as FSDP2's
        shared state context does), this unit's before it (the root's seeds its context)."""
        if name not in TREE_SETTINGS:
            raise AttributeError(f"not a tree-wide setting: {name!r}")
        if self.ctx is not None:
            self.ctx.set_tree_setting(name, value)
        else:
            setattr(self, name, value)

    def prepare_group(self) -> None:
        """Per-unit plans built once the storage exists (lazy init, and after a rebuild):
        the unsharded parameters, the plugins' gradient reducers, the root's prefetch hook."""
        group = self.group
        assert group is not None
        group.take_up_late_extensions()
        group.name_unit(self.view, self.fqn)
        group.configure(fill_input=self.port.all_gather_input(self.view))  # asks the transport
        group.init_unsharded()
        hooks = self.port.gradient_hooks(self.view)
        self.reducers = hooks.reducers
        for p in group.params:
            p.land_grads_through(hooks.land_grad)
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
        options = self.options
        if (
            rebuild_storage(self.group, options.unit_spec, options.unit_fqns, self.port)
            and self.ctx
        ):
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
            args, kwargs = ctx.begin_forward(self, args, kwargs)
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
            args, kwargs = register_post_backward(self, args, kwargs)
        return self._transform_inputs(args, kwargs)

    def _forward_prefetch(self, ctx: RootContext) -> None:
        targets = self.options.forward_prefetch
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
                    ctx.comm.order_gathers(False)  # until the next root pre-forward
                return self._transform_output(output)
        self._complete_forward(ctx)
        output = register_pre_backward(self.backward_pre_hook, output)
        if ctx.iter_forward_root is self:
            self._root_post_forward(ctx, output)
        return self._transform_output(output)

    def _complete_forward(self, ctx: RootContext) -> None:
        self._transition("forward_post")
        if self.group is not None and not ctx.in_backward:
            # a create_graph graph still reads the unsharded parameters: keep them
            raf = self.options.reshard_after_forward if not ctx.graph_holds_params else False
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
                register_pre_backward(state.backward_pre_hook, output)
            elif state.prefetched:
                state.prefetched = False
                state.group.reshard()  # prefetched, but not run this iteration
        ctx.end_forward()

    # -- backward -----------------------------------------------------------------------------

    def pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.training_state is S.PRE_BACKWARD:
            return grad
        ctx = self.ctx
        assert ctx is not None
        self._transition("backward_pre")
        ctx.begin_backward()
        group = self.group
        if group is not None and self.options.unshard_in_backward:
            group.unshard(self.comm)
        if self.is_root and self.options.backward_prefetch is None and self.can_defer_prefetch:
            # The root's backward (loss, output head) is where activation memory peaks:
            # prefetch once its first gradient is accumulated, past that peak.
            self.deferred_prefetch = True
        else:
            self._backward_prefetch(ctx)
        if group is not None and self.options.unshard_in_backward:
            group.wait_for_unshard(self.comm)
        return grad

    def _backward_prefetch(self, ctx: RootContext) -> None:
        targets = self.options.backward_prefetch
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
                and target.options.unshard_in_backward
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
            if state is S.IDLE and not (
                group is not None and self.options.reduce_scatter_unused_params
            ):
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
        if reshard and self.options.reshard_after_backward:
            group.reshard()
        if self.options.requires_gradient_sync:
            # RFC 6.3: wait for the earlier units' reduce-scatters (at most
            # max_reduce_buffers - 1 stay in flight), issue ours, and only then finish the
            # earlier ones: their reducers' data-parallel all-reduces are issued after our
            # reduce-scatter, never queued ahead of it.
            earlier = ctx.wait_reductions(keep=self.options.max_reduce_buffers - 1)
            reductions = group.reduce(
                self.comm, include_unused=self.options.reduce_scatter_unused_params
            )
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
        """End-of-backward callback of the root (``drain.py``)."""
        drain(self.ctx)

    def end_unit(self, keep_unsharded: bool = False) -> None:
        self.training_state = S.IDLE
        self.modules_to_run.clear()
        self.deferred_prefetch = False
        group = self.group
        if group is not None:
            if group.has_pending or (self.options.reshard_after_backward and not keep_unsharded):
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
