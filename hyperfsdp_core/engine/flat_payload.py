"""A bucket's plain payload (:class:`FlatPayload`): the members' shards in one flat buffer,
gathered into one flat buffer their unsharded parameters alias.

Three flat buffers:

* ``sharded_flat`` (original dtype): every member's padded shard back to back; the
  members' DTensor local tensors are views of it, so it *is* the all-gather input
  (no copy-in unless a cast is needed);
* ``unsharded_flat`` (compute dtype, param-major, ``world * total``): the members'
  unsharded parameters alias it; its storage is freed (resized to 0, or parked for the
  next unshard on CPU) on reshard and re-allocated on unshard, so autograd's saved
  references stay valid. Who owns that memory: :class:`~.param.StorageOwner`;
* a reduce-scatter pack (reduce dtype, rank-major), borrowed per step (``Comm.buffer``,
  ``engine/reduction.py``).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..comm import READY, Comm, Handle
from .bucket import Bucket
from .buffers import alias, free, standalone
from .gather_layout import GatherViews, copy_out, gather_views
from .layout import pack_segments
from .lifecycle import BucketState
from .mesh_info import MeshInfo
from .param import StorageOwner
from .post_forward import PostForward

B = BucketState


def _copy_in(src: torch.Tensor, dest: torch.Tensor) -> None:
    """The default all-gather input: the sharded storage, cast and/or moved (a plain copy;
    the offload plugin overlaps its host-to-device copies itself)."""
    dest.copy_(src)


class FlatPayload:
    """The flat buffers of one bucket (``bucket``) and their life per unshard."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        params = bucket.params
        self.segments, self.total = pack_segments([p.layout.padded_numel for p in params])
        self.sharded_flat: torch.Tensor | None = None
        self.unsharded_flat: torch.Tensor | None = None
        self.unsharded_nbytes = 0  # the unsharded buffer's size, set with it
        # the all-gather input (or unsharded parameter) is a copy of the sharded storage
        self.needs_copy_in = False
        self._staging: torch.Tensor | None = None  # a gather's rank-major output
        self._gather_layout = (bucket.world, self.total, self.segments, [p.layout for p in params])
        # all-gather by all-reduce (gloo): views of the unsharded buffer to zero and to
        # fill with this rank's shards, and those shards (built at first use)
        self._gather_views: GatherViews | None = None
        # every member sharded on dim 0: this rank's part is one row of each member's
        # (world, n) view of the unsharded buffer (gathered row by row)
        self.dim0_rows = all(p.shard_dim == 0 for p in params)
        # reshard_after_forward=<int>: the post-forward shard (held in POST_FORWARD), and on
        # accelerators an event recorded on the current stream once it is written (its
        # all-gather waits for it)
        self._pf: PostForward | None = None
        self._pf_ready = None
        # where resharding parks the unsharded buffer's memory (the comm's, CPU), once an
        # unshard has run; None: freed
        self._storage_pool = None
        # accelerators (None on CPU): the comm of the last unshard, and whether the
        # unsharded buffer's memory came from its all-gather stream
        # (``Comm.release_gathered`` before it is freed)
        self._comm: Comm | None = None
        self._gathered_memory = False

    @property
    def storage_owner(self) -> StorageOwner:
        b = self.bucket
        if not b.needs_all_gather:
            return StorageOwner.CAST_BUFFER if self.needs_copy_in else StorageOwner.SHARDED_STORAGE
        if len(b.params) == 1 and b.params[0].shard_dim == 0:
            return StorageOwner.ALL_GATHER_OUTPUT
        return StorageOwner.FUSED_BUFFER

    def refresh_copy_in(self) -> None:
        """Whether the all-gather input (or unsharded parameter) is a copy of the sharded
        storage: cast, moved from another device (offload), or produced by a plugin."""
        b = self.bucket
        self.needs_copy_in = (
            b.param_dtype != b.orig_dtype
            or b.settings.fill_input is not None
            or (self.sharded_flat is not None and self.sharded_flat.device != b.compute_device)
        )

    def use_storage_pool(self, pool) -> None:
        """Where reshards park the unsharded memory from now on."""
        self._storage_pool = pool

    def bind(self, comm: Comm) -> None:
        """An unshard through ``comm``: the next reshard parks memory with it."""
        self._storage_pool = comm.storage_pool
        if not comm.is_cpu:
            self._comm = comm

    # -- sharded storage --------------------------------------------------------------------
    def build(self, locals_: list[torch.Tensor], device: torch.device, pin_memory: bool) -> None:
        """The flat sharded buffer from each member's actual shard; the members' sharded
        parameters are views of it."""
        pin = pin_memory and device.type == "cpu"
        b = self.bucket
        flat = torch.empty(self.total, dtype=b.orig_dtype, device=device, pin_memory=pin)
        for p, seg, local in zip(b.params, self.segments, locals_):
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
        self._release_unsharded()  # the old unsharded buffer's memory goes with it
        self.unsharded_flat = None
        self._gather_views = None
        self._pf = None

    def adopt(self) -> None:
        raise RuntimeError("hyperfsdp: a plain bucket builds its flat storage (build)")

    def on_meta(self) -> bool:
        return self.sharded_flat is not None and self.sharded_flat.is_meta

    def init_unsharded(self) -> None:
        """Create the stable unsharded Parameters (once per sharded storage).

        They outlive the pass that creates them, so they are never inference tensors, even
        when the first forward runs under ``torch.inference_mode`` (evaluation first).
        """
        if self.unsharded_flat is not None or self.sharded_flat is None:
            return
        b, owner = self.bucket, self.storage_owner
        with torch.inference_mode(False), torch.no_grad():
            if owner is StorageOwner.SHARDED_STORAGE:
                base, scale = self.sharded_flat, 1
            else:
                base = torch.empty(
                    b.world * self.total, dtype=b.param_dtype, device=b.compute_device
                )
                scale = b.world
            for p, seg in zip(b.params, self.segments):
                view = alias(base, scale * seg.offset, p.unsharded_shape, p.unsharded_stride)
                if p.wrap_unsharded is not None:
                    view = p.wrap_unsharded(view)
                p.set_unsharded(nn.Parameter(view, requires_grad=p.requires_grad), owner)
        self.unsharded_flat = base
        self.unsharded_nbytes = base.numel() * base.element_size()
        self._gather_views = None
        if owner is not StorageOwner.SHARDED_STORAGE:
            free(base)

    # -- unshard ------------------------------------------------------------------------------
    def start_gather(self, comm: Comm) -> Handle:
        """Issue the all-gather (the local cast without peers) into the unsharded buffer."""
        self.init_unsharded()
        b = self.bucket
        fill = b.settings.fill_input or _copy_in
        if not b.needs_all_gather:
            if self.needs_copy_in:
                self._alloc_unsharded()
                fill(self.sharded_flat, self.unsharded_flat)
            return READY
        if b.state is B.POST_FORWARD:
            return self._gather_post_forward_shard(comm)
        route = "native"
        if b.settings.fill_input is None:  # the transport asked once: which way it gathers
            route = b.route(comm, self.unsharded_nbytes, self.dim0_rows)
        if route != "native":
            # gloo: straight into the param-major unsharded buffer (no staging, no copy-out)
            self._alloc_unsharded()
            views = self._route_views()
            if views.rows is None:
                route = "in_place"
            fill_own = views.fill_own if route == "rows" else views.fill_all
            return b.gather(comm, route, self.unsharded_flat, rows=views.rows, prepare=fill_own)
        # the all-gather may skip waiting for the current stream in an ordered forward
        # (``Comm.gathers_ordered``) if it writes only into memory fresh from its stream
        transport = b.settings.transport
        allocates = transport is not None and transport.allocator("gather") is not None
        if self.storage_owner is StorageOwner.ALL_GATHER_OUTPUT and not allocates:
            fresh = self._alloc_unsharded(comm)
            out = self.unsharded_flat
        else:  # the unsharded buffer is allocated at copy-out, not while the gather runs
            out = self._staging = comm.buffer(
                b.world * self.total, b.param_dtype, "gather", transport
            )
            fresh = True
        own, prepare = self.sharded_flat, None
        if self.needs_copy_in:  # cast/copy straight into this rank's slot: in-place all-gather
            rank = b.mesh_info.shard_rank
            own = out[rank * self.total : (rank + 1) * self.total]
            prepare = partial(fill, self.sharded_flat, own)
        return b.gather(comm, route, out, own=own, prepare=prepare, ordered=fresh)

    def _route_views(self) -> GatherViews:
        views = self._gather_views
        if views is None:
            b = self.bucket
            views = self._gather_views = gather_views(
                b.params,
                self.segments,
                self.unsharded_flat,
                self.sharded_flat,
                b.world,
                b.mesh_info.shard_rank,
            )
        return views

    def _gather_post_forward_shard(self, comm: Comm) -> Handle:
        """The backward's all-gather over the smaller group, from the post-forward shard."""
        b, pf = self.bucket, self._pf
        ready, self._pf_ready = self._pf_ready, None
        if ready is not None:  # written on the current stream by keep_post_forward
            comm.all_gather_stream.wait_event(ready)
        if pf.direct:  # one dim-0 member laid out alike: straight into the buffer
            fresh = self._alloc_unsharded(comm)
            out = self.unsharded_flat[: pf.info.shard_size * pf.total]
        else:
            out = self._staging = comm.buffer(
                pf.info.shard_size * pf.total, b.param_dtype, "gather", b.settings.pf_transport
            )
            fresh = True
        return comm.all_gather(
            out,
            pf.flat,
            pf.info.shard_group,
            b.settings.pf_transport,
            unit=b.settings.unit_fqn,
            ordered=fresh and ready is not None,
        )

    def finish_gather(self, comm: Comm, *, from_post_forward: bool) -> None:
        """The gather is complete: copy a staged output out into the unsharded buffer."""
        if self._staging is not None:
            b = self.bucket
            self._alloc_unsharded()
            layout = self._pf.gather_layout if from_post_forward else self._gather_layout
            copy_out(b.params, self.segments, b.world, self.unsharded_flat, self._staging, layout)
            transport = b.settings.pf_transport if from_post_forward else b.settings.transport
            comm.recycle(self._staging, "gather", transport)
            self._staging = None
        if self._pf is not None:
            free(self._pf.flat)  # a post-forward shard gathered from (or none held)

    # -- reshard ------------------------------------------------------------------------------
    def keep_post_forward(self, info: MeshInfo) -> bool:
        """Reshard to the smaller group ``info``: keep each member's chunk over it for
        backward, registered as FSDP2 does (DTensors on the post-forward mesh,
        ``(Replicate(), Shard(d))``, whose local tensors are those chunks, back to back as
        the backward's all-gather input)."""
        b, pf = self.bucket, self._pf
        if pf is None or pf.info is not info:
            pf = self._pf = PostForward(
                b.params,
                info,
                gathered_numel=b.world * self.total,
                dtype=b.param_dtype,
                device=b.compute_device,
            )
        pf.keep(b.params)
        comm = self._comm
        self._pf_ready = None if comm is None else comm.current_stream().record_event()
        self._free_unsharded()
        for p, param in zip(b.params, pf.params):
            p.to_post_forward(param)
        return True

    def release(self, state: BucketState) -> None:
        """Reshard from ``state``: free what this payload holds."""
        self._staging = None
        self._pf_ready = None
        if self._pf is not None:  # held, or an unshard from it nobody waited for
            free(self._pf.flat)
        self._free_unsharded()

    def _alloc_unsharded(self, comm: Comm | None = None) -> bool:
        """Give the unsharded buffer its memory: parked memory of its size if any is idle.

        ``comm``: an all-gather will write into it, so on accelerators the memory comes
        from the all-gather stream (see ``Comm.gather_allocation``). Returns whether it
        was allocated now (False: it already had its memory).
        """
        storage = self.unsharded_flat.untyped_storage()
        nbytes = self.unsharded_nbytes
        if storage.size() == nbytes:
            return False
        pool = self._storage_pool
        if pool is None or storage.size() != 0 or not pool.unpark(storage, nbytes):
            if comm is not None and not comm.is_cpu:
                with comm.gather_allocation():
                    storage.resize_(nbytes)
                self._gathered_memory = True
            else:
                storage.resize_(nbytes)
        return True

    def _free_unsharded(self) -> None:
        """Reshard's release of the unsharded buffer: parked for the next unshard (CPU)."""
        flat = self.unsharded_flat
        if flat is None or flat is self.sharded_flat:
            return
        storage = flat.untyped_storage()
        if storage.size() == 0:
            return
        self._release_unsharded()
        if self._storage_pool is not None:
            self._storage_pool.park(storage)
        else:
            storage.resize_(0)

    def _release_unsharded(self) -> None:
        """Before memory the all-gather stream allocated for the unsharded buffer is freed."""
        if self._gathered_memory:
            self._gathered_memory = False
            self._comm.release_gathered()
