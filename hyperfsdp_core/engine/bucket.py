"""One bucket: the members of a unit that share topology and dtypes, one flat sharded
buffer, one all-gather and one reduce-scatter (see ``unit_params`` for the unit).

A bucket owns three flat buffers:

* ``sharded_flat`` (original dtype): every member's padded shard back to back; the
  members' DTensor local tensors are views of it, so it *is* the all-gather input
  (no copy-in unless a cast is needed);
* ``unsharded_flat`` (compute dtype, param-major, ``world * total``): the members'
  unsharded parameters alias it; its storage is freed (resized to 0) on reshard and
  re-allocated on unshard (``engine/unsharded.py``), so autograd's saved references stay
  valid;
* a reduce-scatter pack (reduce dtype, rank-major), borrowed per step (``Comm.buffer``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..comm import READY, Comm, Handle, Transport
from .buffers import free, standalone
from .gather_layout import GatherViews, copy_out, gather_views
from .layout import pack_segments
from .lifecycle import BUCKET_TRANSITIONS, BucketState
from .mesh_info import MeshInfo
from .param import ShardedParam, StorageOwner
from .post_forward import PostForward
from .unsharded import UnshardedMemory


def _copy_in(src: torch.Tensor, dest: torch.Tensor) -> None:
    """The default all-gather input: the sharded storage, cast and/or moved (a plain copy;
    the offload plugin overlaps its host-to-device copies itself)."""
    dest.copy_(src)


B = BucketState


class Bucket(UnshardedMemory):
    """Parameters that share topology and dtypes: one all-gather, one reduce-scatter.

    Its lifecycle is one :class:`~.lifecycle.BucketState` (``state``), changed only through
    :meth:`_move` against ``lifecycle.BUCKET_TRANSITIONS``; the other fields are data: the
    in-flight gather's handle (``pending``) and output awaiting copy-out (``_staging``).
    """

    def __init__(self, params: list[ShardedParam], device: torch.device) -> None:
        first = params[0]
        self.params = params
        self.compute_device = device  # where the unsharded parameters and collectives live
        self.unit = None  # the unit's view (an opaque handle for reductions)
        self.mp_policy = None  # the unit's MixedPrecisionPolicy (the extension's pre-gather)
        self.unit_fqn: str | None = None
        # hyperfsdp_all_gather_input: fn(sharded_flat, dest) writes the all-gather input
        self.fill_input: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self.mesh_info: MeshInfo = first.mesh_info
        self.world = first.mesh_info.shard_size
        self.orig_dtype = first.orig_dtype
        self.param_dtype = first.param_dtype
        self.reduce_dtype = first.reduce_dtype
        self.needs_copy_in = self.param_dtype != self.orig_dtype
        self.segments, self.total = pack_segments([p.layout.padded_numel for p in params])
        self.sharded_flat: torch.Tensor | None = None
        self.unsharded_flat: torch.Tensor | None = None
        self.unsharded_nbytes = 0  # the unsharded buffer's size, set with it
        self.state = B.SHARDED
        self.pending: Handle | None = None  # the all-gather in flight (GATHERING*)
        self._staging: torch.Tensor | None = None  # its output, rank-major, to copy out
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        # reshard_after_forward=<int>: the smaller group and its layout (built at first use;
        # its shard ``_pf.flat`` is held in POST_FORWARD)
        self.post_forward: MeshInfo | None = None
        self._pf: PostForward | None = None
        self._gather_layout = (
            self.world,
            self.total,
            self.segments,
            [p.layout for p in params],
        )
        # what carries this bucket's collectives (``UnitParams.apply_settings``: the
        # unit's FSDP2-style comm objects over its plugin transport), None: the root's
        # default; and an optional separate process group for reduce-scatters
        self.transport: Transport | None = None
        # the post-forward gathers' (reshard_after_forward=<int>): the plugin's transport
        # only (FSDP2's custom comms are for the unit's own group)
        self.pf_transport: Transport | None = None
        self.custom_all_gather = None  # the unit's ``set_custom_all_gather`` object
        self.reduce_group: dist.ProcessGroup | None = None
        self.divide_factor: float = float(self.mesh_info.dp_size)
        self.reduce_key: tuple[bool, ...] | None = None  # see reduction.reduce_plan
        self.reduce_plan = None
        # all-gather by all-reduce (gloo): views of the unsharded buffer to zero and to
        # fill with this rank's shards, and those shards (built at first use)
        self._gather_views: GatherViews | None = None
        # every member sharded on dim 0: this rank's part is one row of each member's
        # (world, n) view of the unsharded buffer (gathered row by row)
        self.dim0_rows = all(p.shard_dim == 0 for p in params)
        # where resharding parks the unsharded buffer's memory (the comm's, CPU), once an
        # unshard has run; None: freed
        self._storage_pool = None
        # accelerators (None on CPU): the comm of the last unshard; whether the unsharded
        # buffer's memory came from its all-gather stream (``Comm.release_gathered``
        # before it is freed); and an event recorded on the current stream once the
        # post-forward shard is written (its all-gather waits for it)
        self._comm: Comm | None = None
        self._gathered_memory = False
        self._pf_ready = None

    def _move(self, event: str) -> None:
        """Change ``state`` by ``event`` (``lifecycle.BUCKET_TRANSITIONS``)."""
        try:
            self.state = BUCKET_TRANSITIONS[event][self.state]
        except KeyError:
            raise RuntimeError(
                f"hyperfsdp: a bucket of unit {self.unit_fqn!r} got {event!r} in state "
                f"{self.state}; if a previous iteration raised, call reset_iter_state() on "
                "the root module"
            ) from None

    @property
    def is_gathering(self) -> bool:
        return self.state is B.GATHERING or self.state is B.GATHERING_FROM_POST_FORWARD

    @staticmethod
    def key(p: ShardedParam) -> tuple:
        return (p.mesh_info, p.orig_dtype, p.param_dtype, p.reduce_dtype, p.extension)

    @property
    def needs_all_gather(self) -> bool:
        return self.world > 1

    def configure(
        self,
        *,
        unit,
        unit_fqn: str | None,
        mp_policy,
        fill_input: Callable[[torch.Tensor, torch.Tensor], None] | None,
        divide_factor: float | None,
        all_reduce_hook: Callable[[torch.Tensor], None] | None,
        custom_all_gather,
        transport: Transport | None,
        pf_transport: Transport | None,
        reduce_group: dist.ProcessGroup | None,
        post_forward: MeshInfo | None,
    ) -> None:
        """The unit's settings for this bucket (``UnitParams.apply_settings``, also after the
        buckets are rebuilt); ``divide_factor``/``post_forward`` ``None``: unchanged."""
        self.unit, self.unit_fqn, self.mp_policy = unit, unit_fqn, mp_policy
        self.fill_input = fill_input
        self.refresh_copy_in()
        if divide_factor is not None:
            self.divide_factor = divide_factor
        self.all_reduce_hook = all_reduce_hook
        self.custom_all_gather = custom_all_gather
        self.transport, self.pf_transport = transport, pf_transport
        self.reduce_group = reduce_group
        if post_forward is not None and post_forward is not self.post_forward:
            self.post_forward, self._pf = post_forward, None

    def use_storage_pool(self, pool) -> None:
        """Where reshards park the unsharded buffer's memory from now on (``share_comm_ctx``)."""
        self._storage_pool = pool

    def cached_reduce_plan(self, key: tuple, build: Callable[[Bucket], Any]) -> Any:
        """The reduce plan ``build(self)`` made for ``key`` (the members' ``requires_grad``),
        kept until the key changes or the storage is rebuilt."""
        if key != self.reduce_key or self.reduce_plan is None:
            self.reduce_plan, self.reduce_key = build(self), key
        return self.reduce_plan

    def refresh_copy_in(self) -> None:
        """Whether the all-gather input (or unsharded parameter) is a copy of the sharded
        storage: cast, moved from another device (offload), or produced by a plugin."""
        self.needs_copy_in = (
            self.param_dtype != self.orig_dtype
            or self.fill_input is not None
            or (self.sharded_flat is not None and self.sharded_flat.device != self.compute_device)
        )

    @property
    def device(self) -> torch.device:
        return self.compute_device

    @property
    def padding_numel(self) -> int:
        return sum(p.layout.padding_numel for p in self.params)

    def gathers_in_line(self, comm: Comm) -> bool:
        """Whether this bucket's next unshard runs to completion in the calling thread
        when it is issued (a local copy or cast on CPU, or a gather its transport completes
        when issued, such as shared memory): prefetching it would overlap nothing, only
        hold it longer. Asks the transport, which never runs a collective to answer."""
        if not comm.is_cpu or self.custom_all_gather is not None:
            return False
        if not self.needs_all_gather:
            return True
        if self.state is B.POST_FORWARD:
            return comm.gathers_in_line(self.pf_transport, self._pf.info.shard_group)
        return comm.gathers_in_line(self.transport, self.mesh_info.shard_group)

    # -- sharded storage --------------------------------------------------------------------
    def build_sharded(
        self, locals_: list[torch.Tensor], device: torch.device, pin_memory: bool = False
    ) -> None:
        """(Re)build the flat sharded buffer from each member's actual shard."""
        pin = pin_memory and device.type == "cpu"
        flat = torch.empty(self.total, dtype=self.orig_dtype, device=device, pin_memory=pin)
        for p, seg, local in zip(self.params, self.segments, locals_):
            slot = flat[seg.offset : seg.offset + seg.numel].view(p.layout.padded_shape)
            actual = slot.narrow(p.shard_dim, 0, p.layout.actual_len)
            if device.type != "meta":
                actual.copy_(local)
                if p.layout.padding_numel:
                    slot.narrow(
                        p.shard_dim,
                        p.layout.actual_len,
                        p.layout.padding_numel // p.layout.row_numel,
                    ).zero_()
            p.install_sharded(standalone(actual), slot)
        self.sharded_flat = flat
        self.refresh_copy_in()
        self._release_unsharded()  # the old unsharded buffer's memory goes with it
        self.unsharded_flat = None
        self._gather_views = None
        self._pf = None
        self.pending = self._staging = None
        self._move("rebuild")
        self.reduce_key = None

    # -- unshard / reshard -----------------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.state is B.UNSHARDED

    def start_unshard(self, comm: Comm) -> None:
        """Issue the all-gather (or the local cast); idempotent while unsharded or in flight."""
        # the next reshard parks the memory with this comm (the root's, once it exists)
        self._storage_pool = comm.storage_pool
        if not comm.is_cpu:
            self._comm = comm
        if self.state is B.UNSHARDED or self.is_gathering:
            return
        self.init_unsharded()
        assert self.unsharded_flat is not None and self.sharded_flat is not None
        if not self.needs_all_gather:
            if self.needs_copy_in:
                self._alloc_unsharded()
                (self.fill_input or _copy_in)(self.sharded_flat, self.unsharded_flat)
            handle = READY
        elif self.state is B.POST_FORWARD:
            handle = self._gather_post_forward_shard(comm)
        else:
            handle = self._gather(comm)
        self.pending = handle  # issued: the state says so only now (a raise leaves it)
        self._move("unshard")

    def _gather_post_forward_shard(self, comm: Comm) -> Handle:
        """The backward's all-gather over the smaller group, from the post-forward shard."""
        pf = self._pf
        ready, self._pf_ready = self._pf_ready, None
        if ready is not None:  # written on the current stream by reshard_post_forward
            comm.all_gather_stream.wait_event(ready)
        if pf.direct:  # one dim-0 member laid out alike: straight into the buffer
            fresh = self._alloc_unsharded(comm)
            out = self.unsharded_flat[: pf.info.shard_size * pf.total]
        else:
            out = self._staging = comm.buffer(
                pf.info.shard_size * pf.total, self.param_dtype, "gather", self.pf_transport
            )
            fresh = True
        return comm.all_gather(
            out,
            pf.flat,
            pf.info.shard_group,
            self.pf_transport,
            unit=self.unit_fqn,
            ordered=fresh and ready is not None,
        )

    def _gather(self, comm: Comm) -> Handle:
        """The all-gather over the shard group, by the route the transport takes."""
        transport = self.transport
        group = self.mesh_info.shard_group
        route = "native"
        if self.fill_input is None:  # the transport asked once: which way it gathers
            route = comm.gather_route_of(transport, group, self.unsharded_nbytes, self.dim0_rows)
        if route != "native":
            # gloo: straight into the param-major unsharded buffer (no staging, no copy-out)
            self._alloc_unsharded()
            views = self._gather_views
            if views is None:
                views = self._gather_views = gather_views(
                    self.params,
                    self.segments,
                    self.unsharded_flat,
                    self.sharded_flat,
                    self.world,
                    self.mesh_info.shard_rank,
                )
            flat, unit = self.unsharded_flat, self.unit_fqn
            if views.rows is not None and route == "rows":
                rank = self.mesh_info.shard_rank
                return comm.all_gather_rows(
                    flat, views.rows, rank, group, transport, unit=unit, prepare=views.fill_own
                )
            return comm.all_gather_in_place(
                flat, group, transport, unit=unit, prepare=views.fill_all
            )
        # the all-gather may skip waiting for the current stream in an ordered forward
        # (``Comm.gathers_ordered``) if it writes only into memory fresh from its stream
        allocates = transport is not None and transport.allocator("gather") is not None
        if self.storage_owner is StorageOwner.ALL_GATHER_OUTPUT and not allocates:
            fresh = self._alloc_unsharded(comm)
            out = self.unsharded_flat
        else:  # the unsharded buffer is allocated at copy-out, not while the gather runs
            out = self._staging = comm.buffer(
                self.world * self.total, self.param_dtype, "gather", transport
            )
            fresh = True
        inp, prepare = self.sharded_flat, None
        if self.needs_copy_in:  # cast/copy straight into this rank's slot: in-place all-gather
            rank = self.mesh_info.shard_rank
            slot = out[rank * self.total : (rank + 1) * self.total]
            prepare = partial(self.fill_input or _copy_in, inp, slot)
            inp = slot
        return comm.all_gather(
            out, inp, group, transport, unit=self.unit_fqn, prepare=prepare, ordered=fresh
        )

    def finish_unshard(self, comm: Comm) -> None:
        """Wait for the all-gather, copy out, and register the unsharded parameters."""
        if not self.is_gathering:
            return
        self.pending.wait()
        self.pending = None
        if self._staging is not None:
            self._alloc_unsharded()
            own = self.state is B.GATHERING  # else from the post-forward shard
            layout = self._gather_layout if own else self._pf.gather_layout
            flat = self.unsharded_flat
            copy_out(self.params, self.segments, self.world, flat, self._staging, layout)
            comm.recycle(self._staging, "gather", self.transport if own else self.pf_transport)
            self._staging = None
        if self._pf is not None:
            free(self._pf.flat)  # a post-forward shard gathered from (or none held)
        for p in self.params:
            p.to_unsharded()
        self._move("gathered")

    def reshard_post_forward(self) -> None:
        """Reshard to the smaller group: keep each member's chunk over it for backward.

        As in FSDP2, the members registered until backward are DTensors on the
        post-forward mesh (``(Replicate(), Shard(d))``) whose local tensors are those
        chunks, laid out back to back as the backward's all-gather input.
        """
        info = self.post_forward
        if info is None or self.state is not B.UNSHARDED or not self.needs_all_gather:
            self.reshard()
            return
        pf = self._pf
        if pf is None:
            pf = self._pf = PostForward(
                self.params,
                info,
                gathered_numel=self.world * self.total,
                dtype=self.param_dtype,
                device=self.device,
            )
        pf.keep(self.params)
        comm = self._comm
        self._pf_ready = None if comm is None else comm.current_stream().record_event()
        self._free_unsharded()
        for p, param in zip(self.params, pf.params):
            p.to_post_forward(param)
        self._move("reshard_post_forward")

    def reshard(self) -> None:
        """Back to the sharded parameters, from any state; frees what the bucket holds."""
        state = self.state
        if state is B.POST_FORWARD:  # held, never gathered from
            self._pf_ready = None
            free(self._pf.flat)
        elif self.is_gathering:  # an unshard nobody waited for (e.g. a prefetch)
            if self.pending is not None:
                self.pending.abandon()
            self.pending = None
            self._staging = None
            self._pf_ready = None
            if self._pf is not None:
                free(self._pf.flat)
        if state is not B.SHARDED and state is not B.GATHERING:  # else registered already
            for p in self.params:
                p.to_sharded()
        self._free_unsharded()
        self._move("reshard")

    # -- gradients ----------------------------------------------------------------------------
    def keep_grads(self) -> None:
        for p in self.params:
            p.keep_unsharded_grad()
