"""FSDP2's all-gather extension for tensor subclasses (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``): torchao's float8 and int8 training weights, and any subclass
written to that protocol.

A parameter whose (TP-)local tensor defines both methods goes to a bucket of its unit
whose payload is an :class:`ExtensionPayload` (``Bucket.key`` tells them apart). There:

* its sharded local tensor stays the subclass: a prefix view of a padded subclass
  tensor made with ``new_zeros`` (the padding rows are zero), wrapped in the DTensor the
  optimizer updates;
* each unshard asks every member's local tensor for its payload
  (``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)``, or the
  older ``fsdp_pre_all_gather(mesh)``): tensors of any dtype plus metadata. The payloads
  of all members are laid out as bytes, back to back, in one row per rank and gathered
  in one all-gather (``uint8``): the collective moves the payload bytes, not the
  parameter's;
* each payload tensor is copied out of the gathered rows into a per-parameter output of
  its own dtype (``world * numel``) kept across iterations (its memory is freed at
  reshard and re-allocated at unshard, as FSDP2 does), and ``fsdp_post_all_gather``
  builds the unsharded parameter from them: the first time it returns ``(tensor,
  inner_tensors)``; afterwards it is called with ``out=`` the unsharded parameter, whose
  inner tensors then alias the same (re-allocated) memory;
* gradients are plain tensors of the parameter's shape, reduced like any other bucket's.

Uneven dim 0 (FSDP2 requires payloads of the padded shard size, so its float8
all-gather fails there): the payload tensor whose shape is this rank's actual shard shape
is a *row* payload. On a rank with fewer rows it is padded to the padded shard shape in
the gathered row (the padding bytes are zero and never seen), and after the gather its
output is narrowed to the parameter's dim-0 size before ``fsdp_post_all_gather`` sees it.
Every other payload tensor (scales, metadata tensors) must have the same shape on every
rank; ``fsdp_post_all_gather`` gets them as FSDP2 gives them (the ranks' tensors
concatenated on dim 0). A rank whose shard is empty calls ``fsdp_pre_all_gather`` on an
empty tensor.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from .._torch_private import dtensor_local_tensor, foreach_copy_, foreach_zero_, storage_id
from ..comm import READY, Comm, Handle
from .bucket import Bucket
from .buffers import free
from .extension import pre_arity
from .lifecycle import BucketState
from .mesh_info import MeshInfo
from .param import ShardedParam, StorageOwner


def _shard_mesh(info):
    """The 1-D mesh the extension's collectives run over (FSDP2's shard mesh)."""
    mesh = info.mesh
    if mesh.ndim == 1 or info.shard_mesh_dim is None:
        return mesh
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "the all-gather extension needs a named mesh for HSDP (init_device_mesh(..., "
            "mesh_dim_names=...))"
        )
    return mesh[names[info.shard_mesh_dim]]


class _Member:
    """One extension parameter's payload layout and its persistent gather outputs."""

    __slots__ = (
        "byte_sizes",
        "copy_views",
        "inner",
        "nargs",
        "offset",
        "outputs",
        "pad_from",
        "padded_sizes",
        "rows",
        "shapes",
        "unflat",
    )

    def __init__(
        self, p: ShardedParam, inputs: list[torch.Tensor], world: int, offset: int
    ) -> None:
        lay = p.layout
        actual, padded = tuple(lay.actual_shape), tuple(lay.padded_shape)
        self.offset = offset  # in the byte row of a rank
        self.shapes = [tuple(t.shape) for t in inputs]  # this rank's, checked each unshard
        self.rows = [s in (actual, padded) and len(s) == len(padded) for s in self.shapes]
        self.padded_sizes = [
            padded if row else s for s, row in zip(self.shapes, self.rows, strict=True)
        ]
        self.byte_sizes = [
            math.prod(s) * t.element_size() for s, t in zip(self.padded_sizes, inputs, strict=True)
        ]
        # bytes of each payload this rank fills with data (the rest is padding)
        self.pad_from = [t.numel() * t.element_size() for t in inputs]
        self.outputs = [
            torch.empty(world * math.prod(s), dtype=t.dtype, device=t.device)
            for s, t in zip(self.padded_sizes, inputs, strict=True)
        ]
        # the copy-out writes through byte aliases with their own version counters: the
        # outputs (and the unsharded parameter built on them, saved by autograd) keep theirs
        self.copy_views = [
            torch.empty(0, dtype=torch.uint8, device=o.device).set_(
                o.untyped_storage(), 0, (world, nb), (nb, 1)
            )
            for o, nb in zip(self.outputs, self.byte_sizes, strict=True)
        ]
        rows_total = lay.global_shape[0]
        self.unflat = [
            o.view(-1, *s[1:])[:rows_total] if row else o.view(-1, *s[1:])
            for o, s, row in zip(self.outputs, self.padded_sizes, self.rows, strict=True)
        ]
        self.inner: list[tuple[torch.UntypedStorage, int]] = []

    @property
    def nbytes(self) -> int:
        return sum(self.byte_sizes)

    def alloc(self) -> None:
        for o in self.outputs:
            st = o.untyped_storage()
            nbytes = o.numel() * o.element_size()
            if st.size() != nbytes:
                st.resize_(nbytes)
        for st, nbytes in self.inner:
            if st.size() != nbytes:
                st.resize_(nbytes)

    def free(self) -> None:
        for o in self.outputs:
            free(o)
        for st, _ in self.inner:
            if st.size():
                st.resize_(0)

    def keep_inner(self, inner) -> None:
        """The inner tensors ``fsdp_post_all_gather`` returned: freed at reshard with the
        outputs and re-allocated before the next ``out=`` call (those on an output's
        memory go with it)."""
        own = {storage_id(o) for o in self.outputs}
        seen: set[int] = set()
        for t in inner or ():
            if not isinstance(t, torch.Tensor):
                continue
            st, key = t.untyped_storage(), storage_id(t)
            if key in own or key in seen:
                continue
            seen.add(key)
            self.inner.append((st, st.size()))


class ExtensionPayload:
    """The extension payload of one bucket (``bucket``): its members' padded subclass
    shards, one all-gather of their payload bytes, and their gather outputs."""

    #: the members' unsharded memory: per-member outputs filled by copy-out
    storage_owner = StorageOwner.FUSED_BUFFER

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self._members: list[_Member] | None = None
        self._row_bytes = 0
        self._staging: torch.Tensor | None = None  # the gathered rows, rank-major bytes
        self._metadata: list | None = None  # fsdp_pre_all_gather's, per member
        self._pre_mesh = None
        self._arity: list[int] | None = None  # each member's fsdp_pre_all_gather arity

    def refresh_copy_in(self) -> None:
        """The payload is always the subclass's own (nothing to decide)."""

    def bind(self, comm: Comm) -> None:
        """Nothing kept from the comm of an unshard."""

    def use_storage_pool(self, pool) -> None:
        """Nothing parked: the outputs are per member, freed at reshard."""

    # -- sharded storage --------------------------------------------------------------------
    def build(self, locals_: list[torch.Tensor], device: torch.device, pin_memory: bool) -> None:
        """Each member's padded shard is a subclass tensor of its own (``new_zeros``, as
        FSDP2 pads); the registered local tensor is its prefix view."""
        with torch.no_grad():
            for p, local in zip(self.bucket.params, locals_, strict=True):
                lay = p.layout
                padded = local.new_zeros(lay.padded_shape, device=device)
                actual = padded.narrow(p.shard_dim, 0, lay.actual_len)
                if lay.actual_len and device.type != "meta":
                    actual.copy_(local)
                p.install_sharded(actual, padded)
        self.adopt()

    def adopt(self) -> None:
        """Take the members' sharded parameters as they are, local tensor objects and
        padded slots alike: a member whose local tensor was given the extension's methods
        after ``fully_shard`` (``param._local_tensor.fsdp_pre_all_gather = ...``, as
        FSDP2's users patch it) keeps that object, which carries them."""
        self._members = None
        self._arity = None
        for p in self.bucket.params:
            p.set_unsharded(None)

    def on_meta(self) -> bool:
        return any(dtensor_local_tensor(p.sharded_param).is_meta for p in self.bucket.params)

    def init_unsharded(self) -> None:
        """The unsharded parameters are what ``fsdp_post_all_gather`` builds at the first
        unshard."""

    # -- unshard ------------------------------------------------------------------------------
    def _payloads(self) -> list[tuple[list[torch.Tensor], object]]:
        b = self.bucket
        if self._pre_mesh is None:
            self._pre_mesh = _shard_mesh(b.mesh_info)
        mesh, out = self._pre_mesh, []
        with torch.no_grad():
            locals_ = [dtensor_local_tensor(p.sharded_param) for p in b.params]
            if self._arity is None:
                self._arity = [pre_arity(local) for local in locals_]
            for p, local, arity in zip(b.params, locals_, self._arity, strict=True):
                if local.device != b.compute_device:  # offloaded storage
                    local = local.to(b.compute_device, non_blocking=True)
                if arity == 1:
                    inputs, metadata = local.fsdp_pre_all_gather(mesh)
                else:
                    inputs, metadata = local.fsdp_pre_all_gather(
                        mesh,
                        torch.Size(p.unsharded_shape),
                        p.unsharded_stride,
                        p.module_infos[0][0],
                        b.settings.mp_policy,
                    )
                out.append((list(inputs), metadata))
        return out

    def _lay_out_rows(self, payloads) -> None:
        members, offset = [], 0
        for p, (inputs, _) in zip(self.bucket.params, payloads, strict=True):
            m = _Member(p, inputs, self.bucket.world, offset)
            offset += m.nbytes
            members.append(m)
        self._members = members
        self._row_bytes = offset

    def _check_shapes(self, payloads) -> None:
        for p, m, (inputs, _) in zip(self.bucket.params, self._members, payloads, strict=True):
            shapes = [tuple(t.shape) for t in inputs]
            if shapes != m.shapes:
                raise RuntimeError(
                    f"hyperfsdp: parameter {p.fqn!r}: fsdp_pre_all_gather returned payloads of "
                    f"shapes {shapes}, earlier {m.shapes}; the all-gather extension needs the "
                    "same payload shapes at every unshard"
                )

    def start_gather(self, comm: Comm) -> Handle:
        """Ask every member for its payload and issue one all-gather of their bytes."""
        b = self.bucket
        payloads = self._payloads()
        if self._members is None:
            self._lay_out_rows(payloads)
        else:
            self._check_shapes(payloads)
        self._metadata = [meta for _, meta in payloads]
        world, rank, row_bytes = b.world, b.mesh_info.shard_rank, self._row_bytes
        staging = self._staging = comm.buffer(
            world * row_bytes, torch.uint8, "gather", b.settings.transport
        )
        rows = staging.view(world, row_bytes)
        own = rows[rank]
        srcs, dsts, pads = [], [], []
        for m, (inputs, _) in zip(self._members, payloads, strict=True):
            at = m.offset
            for t, nb, filled in zip(inputs, m.byte_sizes, m.pad_from, strict=True):
                if filled:
                    srcs.append(t.contiguous().view(-1).view(torch.uint8))
                    dsts.append(own[at : at + filled])
                if filled < nb:
                    pads.append(own[at + filled : at + nb])
                at += nb

        def fill(zero_others: bool) -> None:
            if zero_others:
                others = [t for t in (rows[:rank], rows[rank + 1 :]) if t.numel()]
                if others:
                    foreach_zero_(others)
            if srcs:
                foreach_copy_(dsts, srcs)
            if pads:
                foreach_zero_(pads)

        route = b.route(comm, world * row_bytes, True)
        if route == "local":
            fill(False)
            return READY
        prepare = partial(fill, route not in ("native", "rows"))  # in place: zeros elsewhere
        return b.gather(comm, route, staging, own=own, rows=[rows], prepare=prepare)

    def finish_gather(self, comm: Comm, *, from_post_forward: bool) -> None:
        """Copy each payload tensor out of the gathered rows and have
        ``fsdp_post_all_gather`` build (or refill) the unsharded parameters."""
        b = self.bucket
        staging, self._staging = self._staging, None
        rows = staging.view(b.world, self._row_bytes)
        sizes, outs = [], []
        for m in self._members:
            m.alloc()
            sizes += m.byte_sizes
            outs += m.copy_views
        torch.split_with_sizes_copy(rows, sizes, dim=1, out=outs)
        comm.recycle(staging, "gather", b.settings.transport)
        metadata, self._metadata = self._metadata, None
        with torch.inference_mode(False), torch.no_grad():
            for p, m, meta in zip(b.params, self._members, metadata, strict=True):
                self._post_all_gather(p, m, meta)

    def _post_all_gather(self, p: ShardedParam, m: _Member, meta) -> None:
        local = dtensor_local_tensor(p.sharded_param)
        if p.unsharded_param is not None:
            local.fsdp_post_all_gather(tuple(m.unflat), meta, p.param_dtype, out=p.unsharded_param)
            return
        tensor, inner = local.fsdp_post_all_gather(tuple(m.unflat), meta, p.param_dtype)
        if tuple(tensor.shape) != p.unsharded_shape:
            raise RuntimeError(
                f"hyperfsdp: parameter {p.fqn!r}: fsdp_post_all_gather built a "
                f"tensor of shape {tuple(tensor.shape)}, expected {p.unsharded_shape}"
            )
        m.keep_inner(inner)
        if p.wrap_unsharded is not None:
            tensor = p.wrap_unsharded(tensor)
        p.set_unsharded(nn.Parameter(tensor, requires_grad=p.requires_grad), self.storage_owner)

    # -- reshard ------------------------------------------------------------------------------
    def keep_post_forward(self, info: MeshInfo) -> bool:
        """``reshard_after_forward=<int>``: the payload is the subclass's, so the members
        reshard fully (FSDP2 raises for such parameters)."""
        return False

    def release(self, state: BucketState) -> None:
        """Reshard from ``state``: drop an unfinished gather's data, free the outputs."""
        self._staging = None
        self._metadata = None
        if self._members is not None:
            for m in self._members:
                m.free()
