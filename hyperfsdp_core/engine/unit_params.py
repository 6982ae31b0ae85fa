"""A unit's managed parameters: :class:`UnitParams`.

It groups the unit's sharded parameters into buckets (``engine/bucket.py``: one all-gather
and one reduce-scatter each, by data-parallel topology and dtypes; their flat buffers are
described there) with :meth:`UnitParams.rebucket`, applies the unit's settings to every
bucket, asks the plugins for the unit's transport, and unshards, reshards and reduces the
buckets together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .._torch_private import dtensor_local_tensor
from ..comm import Comm, Transport, compose_transport
from . import held as _held
from .bucket import Bucket, UnitSettings
from .extension_payload import ExtensionPayload
from .flat_payload import FlatPayload
from .lifecycle import BucketState
from .param import ShardedParam
from .reduction import Reduction, reduce_bucket

if TYPE_CHECKING:
    from .records import ShardedStorage


class UnitParams:
    """All managed parameters of one ``fully_shard`` call, in buckets.

    Unit-level settings (divide factor, post-forward group size, all-reduce hook) live
    here and are applied to every bucket, also when the buckets are rebuilt.
    """

    def __init__(
        self,
        params: list[ShardedParam],
        device: torch.device,
        storage: ShardedStorage | None = None,
        mp_policy=None,
    ) -> None:
        self.params = params
        self.device = device
        self.storage = storage  # from hyperfsdp_sharded_storage; None: on `device`
        self.unit = None  # the unit's view (opaque; see name_unit)
        self.unit_fqn: str | None = None
        self.mp_policy = mp_policy
        self.fill_input: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self.divide_factor: float | None = None
        self.post_forward_size: int | None = None
        # unsharded memory held past the unit's hooks (see ``hold``), and the unit's root
        # (whose ``in_backward`` says whether held parameters are in use; at lazy init)
        self.held = False
        self._root: _held.Root | None = None
        self.custom_all_gather = None
        self.custom_reduce_scatter = None
        #: the plugin's ``hyperfsdp_transport`` for this unit, asked at lazy init
        #: (``ask_transport``) the next time the settings are applied
        self.plugin_transport: Transport | None = None
        self._transport_question: Callable[[], Transport | None] | None = None
        self.separate_reduce_group = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.rebucket()

    def rebucket(self) -> None:
        """(Re)group the parameters by topology and dtypes (after dtype changes, too)."""
        by_key: dict[tuple, list[ShardedParam]] = {}
        for p in self.params:
            by_key.setdefault(Bucket.key(p), []).append(p)
        self.buckets = [
            Bucket(members, self.device, ExtensionPayload if members[0].extension else FlatPayload)
            for members in by_key.values()
        ]
        self.apply_settings()

    def name_unit(self, view, fqn: str) -> None:
        """The unit's view (handed to reducers with its reductions) and its fqn (named in
        collective events), known from the root's lazy init."""
        self.unit, self.unit_fqn = view, fqn

    def ask_transport(self, question: Callable[[], Transport | None]) -> None:
        """Lazy init: ``question()`` gives the unit's plugin transport (asked once, by the
        next :meth:`apply_settings`, when the unit's fqn is known)."""
        self._transport_question = question

    #: Unit-level settings the ``FSDPModule`` setters (and ``fully_shard``) change.
    SETTINGS = frozenset(
        {
            "divide_factor",
            "post_forward_size",
            "all_reduce_hook",
            "custom_all_gather",
            "custom_reduce_scatter",
            "separate_reduce_group",
            "fill_input",
        }
    )

    def join_root(self, root: _held.Root) -> None:
        """The unit's root (its backwards: held parameters in use, see ``held``)."""
        self._root = root

    def configure(self, **changes) -> None:
        """Change unit-level settings (:data:`SETTINGS`) and apply them to every bucket."""
        unknown = set(changes) - self.SETTINGS
        if unknown:
            raise AttributeError(f"not a unit setting: {sorted(unknown)}")
        for name, value in changes.items():
            setattr(self, name, value)
        self.apply_settings()

    def apply_settings(self) -> None:
        from .mesh_info import post_forward_mesh_info, separate_group

        if self._transport_question is not None:
            question, self._transport_question = self._transport_question, None
            self.plugin_transport = question()
        transport = compose_transport(
            self.custom_all_gather, self.custom_reduce_scatter, self.plugin_transport
        )
        settings = UnitSettings(
            unit=self.unit,
            unit_fqn=self.unit_fqn,
            mp_policy=self.mp_policy,
            fill_input=self.fill_input,
            all_reduce_hook=self.all_reduce_hook,
            custom_all_gather=self.custom_all_gather,
            transport=transport,
            pf_transport=self.plugin_transport,
        )
        for b in self.buckets:
            gathers = b.needs_all_gather
            b.configure(
                settings,
                divide_factor=self.divide_factor,
                reduce_group=(
                    separate_group(b.mesh_info) if self.separate_reduce_group and gathers else None
                ),
                post_forward=(
                    post_forward_mesh_info(b.mesh_info, self.post_forward_size)
                    if self.post_forward_size is not None and gathers
                    else None
                ),
            )

    def build_sharded(self, locals_by_param: dict[int, torch.Tensor], device: torch.device) -> None:
        """(Re)build every bucket's storage on ``device`` (meta), else where the
        storage policy says (pinned host memory under offload), else on ``device``."""
        device, pin = self._storage_place(device)
        for b in self.buckets:
            b.build_sharded([locals_by_param[id(p)] for p in b.params], device, pin)

    def _storage_place(self, device: torch.device) -> tuple[torch.device, bool]:
        if device.type != "meta" and self.storage is not None:
            return self.storage.device, self.storage.pin_memory
        return device, False

    def take_up_late_extensions(self) -> None:
        """Parameters whose sharded local tensor was given the all-gather extension's
        methods after ``fully_shard`` (``param._local_tensor.fsdp_pre_all_gather = ...``)
        use it from now on, as in FSDP2 (which looks them up at every all-gather): asked at
        lazy init and after each storage rebuild. They move to extension buckets keeping
        their local tensor objects (which carry the methods); the other buckets' storage is
        rebuilt around their shards."""
        if not [p for p in self.params if p.gained_extension()]:
            return
        self.reshard()
        locals_by_param = {id(p): dtensor_local_tensor(p.sharded_param) for p in self.params}
        meta = any(t.is_meta for t in locals_by_param.values())
        device, pin = self._storage_place(torch.device("meta") if meta else self.device)
        self.rebucket()
        for b in self.buckets:
            if b.params[0].extension:  # keeps the local tensors that carry the methods
                b.adopt_sharded()
            else:
                b.build_sharded([locals_by_param[id(p)] for p in b.params], device, pin)

    def init_unsharded(self) -> None:
        for b in self.buckets:
            b.init_unsharded()

    @property
    def is_unsharded(self) -> bool:
        return all(b.is_unsharded for b in self.buckets)

    @property
    def is_sharded(self) -> bool:
        return all(b.state is BucketState.SHARDED for b in self.buckets)

    def hold(self) -> None:
        """The unsharded parameters (or the post-forward shard) stay held past the unit's
        hooks: an optimizer step that updates them reshards first (see ``_held``)."""
        if not self.held and (self.is_unsharded or self.holds_post_forward_shard):
            self.held = True
            _held.hold(self)

    @property
    def holds_post_forward_shard(self) -> bool:
        return any(b.state is BucketState.POST_FORWARD for b in self.buckets)

    # -- the _held.Holdable protocol --
    def held_param_ids(self) -> set[int]:
        return {id(p.sharded_param) for p in self.params}

    def drop_held(self) -> None:
        self.reshard()

    def in_backward(self) -> bool:
        return self._root is not None and self._root.in_backward

    @property
    def has_pending(self) -> bool:
        return any(b.is_gathering for b in self.buckets)

    def prefetch_overlaps(self, comm: Comm) -> bool:
        """Whether an unshard issued ahead of time overlaps communication with compute
        (some bucket's gather runs asynchronously, see :meth:`Bucket.gathers_in_line`)."""
        return not all(b.gathers_in_line(comm) for b in self.buckets)

    def unshard(self, comm: Comm) -> None:
        for b in self.buckets:
            b.start_unshard(comm)

    def wait_for_unshard(self, comm: Comm) -> None:
        for b in self.buckets:
            b.finish_unshard(comm)

    def reshard(self) -> None:
        if self.held:
            self.held = False
            _held.release(self)
        for b in self.buckets:
            b.reshard()

    def reshard_post_forward(self) -> None:
        for b in self.buckets:
            b.reshard_post_forward()

    def reduce(self, comm: Comm, *, include_unused: bool) -> list[Reduction]:
        out = []
        for b in self.buckets:
            red = reduce_bucket(b, comm, include_unused=include_unused)
            if red is not None:
                out.append(red)
        return out

    def keep_grads(self) -> None:
        for b in self.buckets:
            b.keep_grads()
