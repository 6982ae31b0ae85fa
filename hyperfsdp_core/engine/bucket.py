"""One bucket: the members of a unit that share topology and dtypes, one all-gather and one
reduce-scatter (see ``unit_params`` for the unit).

The bucket owns the lifecycle (:class:`~.lifecycle.BucketState`), the unit's settings and
the collectives' routes; *what* is gathered is its payload, a strategy it holds:

* :class:`~.flat_payload.FlatPayload`: the members' shards back to back in one flat buffer,
  gathered into the flat buffer their unsharded parameters alias (every plain parameter);
* :class:`~.extension_payload.ExtensionPayload`: the tensors a subclass's
  ``fsdp_pre_all_gather`` gives, gathered as bytes and handed to its
  ``fsdp_post_all_gather`` (FSDP2's all-gather extension: torchao's float8, and others).

Gradients are reduced the same way for both (``engine/reduction.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import torch
import torch.distributed as dist

from ..comm import Comm, Handle, Transport
from .lifecycle import BUCKET_TRANSITIONS, BucketState
from .mesh_info import MeshInfo
from .param import ShardedParam, StorageOwner

B = BucketState


@attrs.frozen
class UnitSettings:
    """The unit's settings every one of its buckets shares (``UnitParams.apply_settings``)."""

    #: the unit's view (an opaque handle for reductions) and its fqn (names collectives)
    unit: Any = None
    unit_fqn: str | None = None
    #: the unit's MixedPrecisionPolicy (handed to ``fsdp_pre_all_gather``)
    mp_policy: Any = None
    #: ``hyperfsdp_all_gather_input``: ``fn(sharded_flat, dest)`` writes the all-gather input
    fill_input: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    #: ``register_comm_hook``-style hook on each reduced output
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    #: the unit's ``set_custom_all_gather`` object
    custom_all_gather: Any = None
    #: what carries the collectives (FSDP2-style comm objects over the plugin transport;
    #: None: the root's default), and the post-forward gathers' (the plugin's only)
    transport: Transport | None = None
    pf_transport: Transport | None = None


class Payload(Protocol):
    """What a bucket gathers: the strategy :class:`Bucket` holds (``FlatPayload``,
    ``ExtensionPayload``), made with the bucket it serves; the bucket calls these in its
    lifecycle and keeps the state."""

    storage_owner: StorageOwner

    def build(self, locals_: list[torch.Tensor], device: torch.device, pin: bool) -> None:
        """New sharded storage from each member's actual shard (installs them)."""

    def adopt(self) -> None:
        """New sharded storage: the members' sharded parameters as they are."""

    def refresh_copy_in(self) -> None:
        """The settings or storage changed: decide again what an unshard copies."""

    def on_meta(self) -> bool:
        """Whether the sharded storage is still on the meta device."""

    def use_storage_pool(self, pool) -> None:
        """Where reshards park unsharded memory from now on."""

    def bind(self, comm: Comm) -> None:
        """An unshard through ``comm`` begins (also when it is already unsharded)."""

    def init_unsharded(self) -> None:
        """Create the unsharded parameters that can exist before the first gather."""

    def start_gather(self, comm: Comm) -> Handle:
        """Issue the unshard's gather (through :meth:`Bucket.gather`)."""

    def finish_gather(self, comm: Comm, *, from_post_forward: bool) -> None:
        """The gather is complete: build or fill the unsharded parameters."""

    def keep_post_forward(self, info: MeshInfo) -> bool:
        """Keep a shard over ``info`` for backward (registered); False: cannot."""

    def release(self, state: BucketState) -> None:
        """Reshard from ``state``: free what the payload holds."""


class Bucket:
    """Parameters that share topology and dtypes: one all-gather, one reduce-scatter.

    Its lifecycle is one :class:`~.lifecycle.BucketState` (``state``), changed only through
    :meth:`_move` against ``lifecycle.BUCKET_TRANSITIONS``; ``pending`` is the all-gather in
    flight (the ``GATHERING`` states).
    """

    def __init__(
        self,
        params: list[ShardedParam],
        device: torch.device,
        payload: Callable[[Bucket], Payload],
    ) -> None:
        first = params[0]
        self.params = params
        self.compute_device = device  # where the unsharded parameters and collectives live
        self.mesh_info: MeshInfo = first.mesh_info
        self.world = first.mesh_info.shard_size
        self.orig_dtype = first.orig_dtype
        self.param_dtype = first.param_dtype
        self.reduce_dtype = first.reduce_dtype
        self.settings = UnitSettings()
        self.divide_factor: float = float(self.mesh_info.dp_size)
        # a separate process group for reduce-scatters, and reshard_after_forward=<int>'s
        # smaller group (None: none)
        self.reduce_group: dist.ProcessGroup | None = None
        self.post_forward: MeshInfo | None = None
        self.state = B.SHARDED
        self.pending: Handle | None = None
        self._reduce_key: tuple[bool, ...] | None = None  # see reduction.reduce_plan
        self._reduce_plan = None
        self.payload: Payload = payload(self)

    def _move(self, event: str) -> None:
        """Change ``state`` by ``event`` (``lifecycle.BUCKET_TRANSITIONS``)."""
        try:
            self.state = BUCKET_TRANSITIONS[event][self.state]
        except KeyError:
            raise RuntimeError(
                f"hyperfsdp: a bucket of unit {self.settings.unit_fqn!r} got {event!r} in "
                f"state {self.state}; if a previous iteration raised, call reset_iter_state() "
                "on the root module"
            ) from None

    @staticmethod
    def key(p: ShardedParam) -> tuple:
        return (p.mesh_info, p.orig_dtype, p.param_dtype, p.reduce_dtype, p.extension)

    @property
    def needs_all_gather(self) -> bool:
        return self.world > 1

    @property
    def is_gathering(self) -> bool:
        return self.state is B.GATHERING or self.state is B.GATHERING_FROM_POST_FORWARD

    @property
    def is_unsharded(self) -> bool:
        return self.state is B.UNSHARDED

    @property
    def storage_owner(self) -> StorageOwner:
        """Who owns the members' unsharded memory (the same for every member)."""
        return self.payload.storage_owner

    def configure(
        self,
        settings: UnitSettings,
        *,
        divide_factor: float | None,
        reduce_group: dist.ProcessGroup | None,
        post_forward: MeshInfo | None,
    ) -> None:
        """The unit's settings for this bucket (``UnitParams.apply_settings``, also after the
        buckets are rebuilt); ``divide_factor`` ``None``: unchanged."""
        self.settings = settings
        if divide_factor is not None:
            self.divide_factor = divide_factor
        self.reduce_group = reduce_group
        self.post_forward = post_forward
        self.payload.refresh_copy_in()

    def use_storage_pool(self, pool) -> None:
        """Where reshards park the unsharded memory from now on (``share_comm_ctx``)."""
        self.payload.use_storage_pool(pool)

    def cached_reduce_plan(self, key: tuple, build: Callable[[Bucket], Any]) -> Any:
        """The reduce plan ``build(self)`` made for ``key`` (the members' ``requires_grad``),
        kept until the key changes or the storage is rebuilt."""
        if key != self._reduce_key or self._reduce_plan is None:
            self._reduce_plan, self._reduce_key = build(self), key
        return self._reduce_plan

    def gathers_in_line(self, comm: Comm) -> bool:
        """Whether this bucket's next unshard runs to completion in the calling thread
        when it is issued (a local copy or cast on CPU, or a gather its transport completes
        when issued, such as shared memory): prefetching it would overlap nothing, only
        hold it longer. Asks the transport, which never runs a collective to answer."""
        if not comm.is_cpu or self.settings.custom_all_gather is not None:
            return False
        if not self.needs_all_gather:
            return True
        if self.state is B.POST_FORWARD:
            return comm.gathers_in_line(self.settings.pf_transport, self.post_forward.shard_group)
        return comm.gathers_in_line(self.settings.transport, self.mesh_info.shard_group)

    # -- sharded storage --------------------------------------------------------------------
    def build_sharded(
        self, locals_: list[torch.Tensor], device: torch.device, pin_memory: bool = False
    ) -> None:
        """(Re)build the sharded storage from each member's actual shard."""
        self.reshard()
        self.payload.build(locals_, device, pin_memory)
        self._rebuilt()

    def adopt_sharded(self) -> None:
        """Keep the members' sharded parameters as they are (an extension bucket built
        around local tensors that gained the extension after ``fully_shard``)."""
        self.reshard()
        self.payload.adopt()
        self._rebuilt()

    def _rebuilt(self) -> None:
        self.payload.refresh_copy_in()
        self._move("rebuild")
        self._reduce_key = None

    def init_unsharded(self) -> None:
        """Create the unsharded parameters that can exist before the first gather."""
        self.payload.init_unsharded()

    # -- unshard / reshard -----------------------------------------------------------------
    def start_unshard(self, comm: Comm) -> None:
        """Issue the all-gather (or the local cast); idempotent while unsharded or in flight."""
        self.payload.bind(comm)
        if self.state is B.UNSHARDED or self.is_gathering:
            return
        self.pending = self.payload.start_gather(comm)
        self._move("unshard")  # issued: the state says so only now (a raise leaves it)

    def gather(
        self,
        comm: Comm,
        route: str,
        out: torch.Tensor,
        *,
        own: torch.Tensor | None = None,
        rows: list[torch.Tensor] | None = None,
        prepare: Callable[[], None] | None = None,
        ordered: bool = False,
    ) -> Handle:
        """Issue the all-gather over the shard group into ``out`` by ``route`` (the
        transport's answer, ``Transport.gather_route``): ``"native"`` from ``own``,
        ``"rows"`` into ``rows`` (views of ``out``), ``"in_place"`` in ``out``'s layout.
        ``prepare()`` writes this rank's part just before it runs; ``ordered``: see
        ``Comm.all_gather``."""
        group, settings = self.mesh_info.shard_group, self.settings
        transport, unit = settings.transport, settings.unit_fqn
        if route == "rows":
            rank = self.mesh_info.shard_rank
            return comm.all_gather_rows(
                out, rows, rank, group, transport, unit=unit, prepare=prepare
            )
        if route != "native":
            return comm.all_gather_in_place(out, group, transport, unit=unit, prepare=prepare)
        return comm.all_gather(
            out, own, group, transport, unit=unit, prepare=prepare, ordered=ordered
        )

    def route(self, comm: Comm, nbytes: int, rows: bool) -> str:
        """How this bucket's all-gather of ``nbytes`` runs (the transport asked, which
        runs no collective to answer): ``"local"`` without peers."""
        if not self.needs_all_gather:
            return "local"
        return comm.gather_route_of(
            self.settings.transport, self.mesh_info.shard_group, nbytes, rows
        )

    def finish_unshard(self, comm: Comm) -> None:
        """Wait for the all-gather, build the unsharded parameters and register them."""
        if not self.is_gathering:
            return
        self.pending.wait()
        self.pending = None
        self.payload.finish_gather(comm, from_post_forward=self.state is not B.GATHERING)
        for p in self.params:
            p.to_unsharded()
        self._move("gathered")

    def reshard_post_forward(self) -> None:
        """Reshard to the smaller group (``reshard_after_forward=<int>``) when the payload
        keeps a post-forward shard, else fully."""
        if (
            self.state is B.UNSHARDED
            and self.post_forward is not None
            and self.needs_all_gather
            and self.payload.keep_post_forward(self.post_forward)
        ):
            self._move("reshard_post_forward")
        else:
            self.reshard()

    def reshard(self) -> None:
        """Back to the sharded parameters, from any state; frees what the bucket holds."""
        state = self.state
        if self.pending is not None:  # an unshard nobody waited for (e.g. a prefetch)
            self.pending.abandon()
            self.pending = None
        if state is not B.SHARDED and state is not B.GATHERING:  # else registered already
            for p in self.params:
                p.to_sharded()
        self.payload.release(state)
        self._move("reshard")

    # -- gradients ----------------------------------------------------------------------------
    def keep_grads(self) -> None:
        for p in self.params:
            p.keep_unsharded_grad()
