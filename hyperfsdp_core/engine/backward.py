"""A unit's backward hooks: unshard for backward (with prefetch), reduce its gradients once
per backward, reshard; the root's end-of-backward callback (``drain.py``).

:class:`BackwardHooks` is the backward half of ``state.UnitState`` (its only subclass), kept
apart so that each half reads in one sitting; it uses the fields ``UnitState`` defines.
"""

from __future__ import annotations

import torch

from .drain import drain
from .lifecycle import TrainingState
from .root import RootContext, finish_reductions

S = TrainingState


class BackwardHooks:
    """The backward half of a unit's hooks (see ``state.UnitState``)."""

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
