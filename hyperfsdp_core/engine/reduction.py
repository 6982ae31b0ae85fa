"""Gradient reduction of one bucket: pack, reduce-scatter (SUM), divide as FSDP2 does, hand on.

The pack is rank-major: row ``r`` of the ``(world, total)`` input holds every member's
rows for rank ``r``, each padded to its slot (uneven tails zeroed). The output is this
rank's slots back to back; the members' gradients are views of it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..comm import READY, Comm, Handle
from .divide import Divisors, gradient_divisors
from .layout import Segment, pack_segments
from .param import ShardedParam

if TYPE_CHECKING:
    from .bucket import Bucket
    from .mesh_info import MeshInfo


class _PackPlan:
    """How one member's full gradient lands in its rank-major reduce-scatter slots."""

    __slots__ = ("chunk", "dim", "numel", "offset", "post", "pre", "quot", "rem", "rows", "world")

    def __init__(self, p: ShardedParam, seg: Segment, world: int) -> None:
        lay = p.layout
        self.offset, self.numel, self.world = seg.offset, seg.numel, world
        self.dim = p.shard_dim
        self.chunk = lay.chunk
        self.rows = lay.global_shape[lay.dim]
        self.quot, self.rem = divmod(self.rows, self.chunk) if self.chunk else (0, 0)
        self.pre = math.prod(lay.global_shape[: lay.dim])
        self.post = math.prod(lay.global_shape[lay.dim + 1 :])

    def pack(self, dst2d: torch.Tensor, grad: torch.Tensor | None) -> None:
        dst = dst2d[:, self.offset : self.offset + self.numel]
        if grad is None:
            dst.zero_()
            return
        if self.dim != 0:  # even by construction: slot r is chunk r of dim `dim`
            src = grad.reshape(self.pre, self.world, self.chunk, self.post).permute(1, 0, 2, 3)
            dst.view(self.world, self.pre, self.chunk, self.post).copy_(src)
            return
        rows = grad.reshape(self.rows, self.post)
        dst3 = dst.view(self.world, self.chunk, self.post)
        q, rem = self.quot, self.rem
        if q:
            dst3[:q].copy_(rows[: q * self.chunk].view(q, self.chunk, self.post))
        if q < self.world:
            if rem:
                dst3[q, :rem].copy_(rows[q * self.chunk :])
            dst3[q, rem:].zero_()
            dst3[q + 1 :].zero_()


class Reduction:
    """One bucket's gradient reduction in one post-backward (see ``plugin.Reduction``).

    The core holds it from creation; reducers may :meth:`defer` it (one more hold
    each) and :meth:`release` it later. When the last hold is released the
    reduction *lands*: the unit's all-reduce hook sees ``output``, then each present
    member's shard is added to its sharded parameter's ``.grad``. :meth:`consume`
    takes the output for good instead (it never lands).

    ``output`` is divided as FSDP2 divides (``_divide``) once the reduce-scatter is done;
    a plugin that all-reduces it over the replicas (hsdp) divides the result by
    ``all_reduce_divisor`` when that is not ``None``.
    """

    __slots__ = (
        "_after_scatter",
        "_bucket",
        "_consumed",
        "_handle",
        "_holds",
        "_pack",
        "_plan",
        "all_reduce_divisor",
        "output",
        "present",
    )

    def __init__(self, bucket, output, handle, pack, plan, present) -> None:
        self._bucket: Bucket = bucket
        self.output: torch.Tensor = output  # this rank's reduced shards, flat, reduce dtype
        self._handle: Handle = handle
        self._pack = pack  # buffer to recycle once the collective is done
        self._plan: ReducePlan = plan
        self.present: list[bool] = present  # which members receive a gradient
        self._holds = 1  # the core's own, released after the unit's reducers ran
        self._consumed = False
        # FSDP2's divisions (``_divide``): of ``output`` once the reduce-scatter is done,
        # and of the replicate all-reduce's result (by the plugin that runs it)
        self._after_scatter: float | None = plan.divisors.after_scatter
        self.all_reduce_divisor: float | None = plan.divisors.after_all_reduce

    # -- public protocol ----------------------------------------------------------------------
    @property
    def params(self) -> tuple[Any, ...]:
        """The members whose gradients ``output`` holds (those that require grad), as the
        plugins' ``ParamView`` objects."""
        return self._plan.views

    @property
    def mesh_info(self) -> MeshInfo:
        return self._bucket.mesh_info

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self._bucket.reduce_dtype

    @property
    def unit(self) -> Any:
        """The unit's ``UnitView``."""
        return self._bucket.settings.unit

    @property
    def key(self) -> tuple:
        """Identifies this bucket's reductions across steps (same members, same layout)."""
        return self._plan.key

    @property
    def consumed(self) -> bool:
        return self._consumed

    @property
    def holds(self) -> int:
        """Holds not released yet (the core's while reducers run, then one per ``defer()``).
        A plugin that must act only after every other holder is done with the reduction
        (the TP all-reduce after the data-parallel one) acts when only its own is left."""
        return self._holds

    def grad_of(self, param: Any) -> torch.Tensor | None:
        """``param``'s reduced shard inside ``output`` (a view of its ``local_shape``), or
        ``None`` when ``param`` is not a member or received no gradient."""
        index = self._plan.index.get(param)
        if index is None or not self.present[index]:
            return None
        p, seg = self._plan.members[index], self._plan.segments[index]
        return self.output[seg.offset : seg.offset + p.actual_numel].view(p.actual_shape)

    def defer(self) -> None:
        """Hold the reduction: it does not land until :meth:`release` is called for this hold."""
        if self._holds <= 0:
            raise RuntimeError("Reduction.defer(): the reduction has already landed")
        self._holds += 1

    def release(self) -> None:
        """Drop one hold; the last one lands the reduction (unless it was consumed)."""
        if self._holds <= 0:
            raise RuntimeError("Reduction.release() called more often than defer()")
        self._holds -= 1
        if self._holds == 0 and not self._consumed:
            self._land()

    def consume(self) -> torch.Tensor:
        """Take ``output`` for good (e.g. to add it into a later reduction); it never lands."""
        self._consumed = True
        return self.output

    # -- engine ---------------------------------------------------------------------------------
    def _wait(self, comm: Comm) -> None:
        self._handle.wait()
        if self._after_scatter is not None:
            self.output.div_(self._after_scatter)
            self._after_scatter = None
        if self._pack is not None:
            comm.recycle(self._pack, "reduce")
            self._pack = None

    def _abandon(self) -> None:
        self._handle.abandon()
        self._holds = 0

    def _land(self) -> None:
        out = self.output
        hook = self._bucket.settings.all_reduce_hook
        if hook is not None:
            hook(out)
        for p, seg, present in zip(self._plan.members, self._plan.segments, self.present):
            if present:
                start = seg.offset
                p.apply_sharded_grad(out[start : start + p.actual_numel].view(p.actual_shape))


class ReducePlan:
    """A bucket's reduce layout over the members that require grad."""

    __slots__ = (
        "divide_key",
        "divisors",
        "index",
        "key",
        "members",
        "plans",
        "segments",
        "simple",
        "total",
        "views",
    )

    def __init__(self, bucket: Bucket) -> None:
        self.members = [p for p in bucket.params if p.requires_grad]
        self.views = tuple(p.view for p in self.members)
        self.index = {v: i for i, v in enumerate(self.views)}
        self.key = (self.views, bucket.reduce_dtype)
        self.segments, self.total = pack_segments([p.layout.padded_numel for p in self.members])
        world = bucket.world
        self.plans = [_PackPlan(p, seg, world) for p, seg in zip(self.members, self.segments)]
        # every member dim-0 and even: one torch.cat packs all gradients at once
        self.simple = all(pl.dim == 0 and pl.rows == world * pl.chunk for pl in self.plans)
        self.divide_key: float | None = None  # the bucket's divide factor `divisors` is for
        self.divisors = Divisors(None, None, None)

    def pack(self, dst2d: torch.Tensor, grads: list) -> None:
        """Lay the members' gradients out rank-major in ``dst2d`` (zeros where missing)."""
        dtype = dst2d.dtype
        if self.simple and all(g is not None and g.dtype == dtype for g in grads):
            world = dst2d.shape[0]
            torch.cat(
                [g.reshape(world, pl.numel) for g, pl in zip(grads, self.plans)], dim=1, out=dst2d
            )
            return
        for plan, g in zip(self.plans, grads):
            plan.pack(dst2d, g)


def reduce_plan(bucket: Bucket) -> ReducePlan:
    """The bucket's cached plan, rebuilt when members' ``requires_grad`` changed."""
    plan = bucket.cached_reduce_plan(tuple(p.requires_grad for p in bucket.params), ReducePlan)
    factor = bucket.divide_factor
    if factor != plan.divide_key:  # set_gradient_divide_factor since
        plan.divisors = gradient_divisors(
            bucket.world, bucket.mesh_info.replicate_size, bucket.reduce_dtype, factor
        )
        plan.divide_key = factor
    return plan


def reduce_bucket(bucket: Bucket, comm: Comm, *, include_unused: bool) -> Reduction | None:
    """Reduce-scatter the members' unsharded gradients (divided as FSDP2 divides them);
    ``None`` when no member requires grad, or none received a gradient (unless
    ``include_unused``: then the missing ones reduce as zeros)."""
    plan = reduce_plan(bucket)
    if not plan.members:
        return None
    grads = [p.take_unsharded_grad() for p in plan.members]
    present = [g is not None for g in grads]
    if include_unused:
        present = [True] * len(grads)
    elif not any(present):
        return None
    if bucket.world == 1:  # nothing to reduce-scatter: the local gradient is the shard's
        output, handle, recycle = _local_output(bucket, plan, grads), READY, None
    else:
        output, handle, recycle = _reduce_scatter(bucket, plan, grads, comm)
    return Reduction(bucket, output, handle, recycle, plan, present)


def _local_output(bucket: Bucket, plan: ReducePlan, grads: list) -> torch.Tensor:
    """World 1: the members' gradients as the output (divided as FSDP2 divides)."""
    g0, rdtype = grads[0], bucket.reduce_dtype
    if len(grads) == 1 and g0 is not None and g0.dtype == rdtype and g0.is_contiguous():
        output = g0.view(-1)  # ours: taken from the unsharded parameter
    else:
        output = torch.empty(plan.total, dtype=rdtype, device=bucket.compute_device)
        plan.pack(output.view(1, plan.total), grads)
    if plan.divisors.before is not None:
        output.div_(plan.divisors.before)
    return output


def _reduce_input(
    bucket: Bucket, plan: ReducePlan, grads: list, comm: Comm
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reduce-scatter input, pre-divided, and the pool buffer it is (None: not one):
    one even member's gradient as it is, else the members' gradients packed rank-major."""
    world, rdtype, transport = bucket.world, bucket.reduce_dtype, bucket.settings.transport
    g0, first = grads[0], plan.plans[0]
    if (
        len(grads) == 1
        and g0 is not None
        and first.dim == 0
        and first.rows == world * first.chunk
        and g0.dtype == rdtype
        and g0.is_contiguous()
        and (transport is None or transport.allocator("reduce") is None)
    ):
        pack, recycle = g0.view(-1), None
    else:
        pack = recycle = comm.buffer(world * plan.total, rdtype, "reduce", transport)
        plan.pack(pack.view(world, plan.total), grads)
        # the gradients are in the pack: the list (the caller's) lets them go before the
        # output is allocated, so it can take their memory (the two are never held together)
        grads.clear()
    if plan.divisors.before is not None:
        pack.div_(plan.divisors.before)
    return pack, recycle


def _reduce_scatter(
    bucket: Bucket, plan: ReducePlan, grads: list, comm: Comm
) -> tuple[torch.Tensor, Handle, torch.Tensor | None]:
    """Issue the reduce-scatter; the output, its handle and the pool buffer to recycle once
    it is done (None: nothing to recycle, or already recycled)."""
    pack, recycle = _reduce_input(bucket, plan, grads, comm)
    output = torch.empty(plan.total, dtype=bucket.reduce_dtype, device=bucket.compute_device)
    transport = bucket.settings.transport
    group = bucket.reduce_group or bucket.mesh_info.shard_group
    # the pack is ours (a pool buffer, or the gradient taken from the unsharded parameter):
    # on gloo the reduction runs in place on it
    handle = comm.reduce_scatter(
        output,
        pack,
        group,
        dist.ReduceOp.SUM,
        transport,
        unit=bucket.settings.unit_fqn,
        scratch_input=True,
    )
    if handle.done:  # it ran in line (shared memory): the pack is free now
        comm.recycle(recycle, "reduce", transport)
        return output, handle, None
    if transport is not None and transport.allocator("reduce") is not None:
        recycle = None  # the transport's comm object owns its buffers: never pooled
    if recycle is None:
        handle.keep_alive(pack)
    return output, handle, recycle
