"""Read-only views of the engine's objects: what plugins are handed (public via ``plugin``).

Each view wraps one engine object and exposes a documented, stable subset of it;
the engine behind a view may change freely. Views are created once per object, so
they can be compared by identity and used as dictionary keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..engine.stash import Stash

if TYPE_CHECKING:
    from ..comm import PluginComm
    from ..engine.mesh_info import MeshInfo
    from ..engine.param import ShardedParam
    from ..engine.root import RootContext
    from ..engine.state import UnitState


class ParamView:
    """One managed parameter.

    Shapes (see the parameter data model in ``docs/design.md``):

    - ``global_shape``: the logical parameter, as the user sees it (the DTensor's shape);
    - ``unsharded_shape``: the plain tensor the core shards and all-gathers back; the
      same as ``global_shape`` unless a layout plugin shards a local tensor (TP);
    - ``local_shape``: this rank's actual shard (``torch.chunk`` rows, maybe 0 rows);
    - ``padded_shape``: this rank's communication slot (``local_shape`` plus padding).
    """

    __slots__ = ("_hyperfsdp_param",)

    def __init__(self, param: ShardedParam) -> None:
        self._hyperfsdp_param = param

    @property
    def fqn(self) -> str:
        """Name relative to the root module once the root ran a forward (before that,
        relative to the unit's module)."""
        return self._hyperfsdp_param.fqn

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self._hyperfsdp_param.global_shape

    @property
    def unsharded_shape(self) -> tuple[int, ...]:
        return self._hyperfsdp_param.unsharded_shape

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self._hyperfsdp_param.actual_shape

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return self._hyperfsdp_param.layout.padded_shape

    @property
    def shard_dim(self) -> int:
        """The dim of the unsharded tensor that is split over the shard group."""
        return self._hyperfsdp_param.shard_dim

    @property
    def shard_offset(self) -> int:
        """Index along ``shard_dim`` of this rank's first row."""
        return self._hyperfsdp_param.layout.offset

    @property
    def orig_dtype(self) -> torch.dtype:
        """dtype of the sharded (master) parameter."""
        return self._hyperfsdp_param.orig_dtype

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the all-gather and of the unsharded parameter."""
        return self._hyperfsdp_param.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        """dtype of the gradient reduction."""
        return self._hyperfsdp_param.reduce_dtype

    @property
    def mesh_info(self) -> MeshInfo:
        return self._hyperfsdp_param.mesh_info

    @property
    def shard_size(self) -> int:
        return self._hyperfsdp_param.mesh_info.shard_size

    @property
    def replicate_size(self) -> int:
        return self._hyperfsdp_param.mesh_info.replicate_size

    @property
    def needs_all_gather(self) -> bool:
        return self._hyperfsdp_param.mesh_info.shard_size > 1

    @property
    def storage_owner(self) -> str:
        """Who owns the memory behind the unsharded parameter: ``"sharded_storage"``,
        ``"cast_buffer"``, ``"all_gather_output"`` or ``"fused_buffer"``."""
        return str(self._hyperfsdp_param.storage_owner)

    @property
    def requires_grad(self) -> bool:
        return self._hyperfsdp_param.sharded_param.requires_grad

    @property
    def device_mesh(self) -> DeviceMesh:
        """Mesh of the sharded DTensor parameter."""
        return self._hyperfsdp_param.dtensor_mesh

    @property
    def placements(self) -> tuple:
        """Placements of the sharded DTensor parameter."""
        return self._hyperfsdp_param.placements

    @property
    def sharded_param(self) -> nn.Parameter:
        """The registered sharded ``DTensor`` parameter (what the optimizer holds). Its
        ``.grad`` is the user-visible gradient; its local tensor this rank's shard."""
        return self._hyperfsdp_param.sharded_param

    @property
    def stash(self) -> Stash:
        """Plugins' per-parameter data, under their own :class:`StashKey`."""
        return self._hyperfsdp_param.stash

    def padded_shard(self) -> torch.Tensor:
        """A copy of this rank's communication slot (``padded_shape``): the actual shard
        followed by its padding rows, which the core keeps zero. For checks (e.g. after a
        checkpoint load); writing to the copy changes nothing."""
        slot = self._hyperfsdp_param.padded_slot
        assert slot is not None
        return slot.detach().clone()

    def __repr__(self) -> str:
        p = self._hyperfsdp_param
        return f"ParamView({p.fqn!r}, {p.global_shape}, {p.mesh_info.describe()})"


class UnitView:
    """One ``fully_shard`` unit: its modules, parameters and current options."""

    __slots__ = ("_unit_state",)

    def __init__(self, state: UnitState) -> None:
        self._unit_state = state

    @property
    def fqn(self) -> str:
        """The unit's module name(s) in the root (``""`` for the root; list units join
        their modules' names with ``", "``). Known from the root's lazy init on."""
        return self._unit_state.fqn

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        return self._unit_state.modules

    @property
    def is_root(self) -> bool:
        return bool(self._unit_state.is_root)

    @property
    def params(self) -> tuple[ParamView, ...]:
        """The unit's managed parameters (empty for a unit that manages none)."""
        return self._unit_state.param_views

    @property
    def device(self) -> torch.device:
        """The device the unit computes and communicates on."""
        return self._unit_state.device

    @property
    def mp_policy(self):
        return self._unit_state.options.mp_policy

    @property
    def offload_policy(self):
        return self._unit_state.options.offload_policy

    @property
    def requires_gradient_sync(self) -> bool:
        return self._unit_state.options.requires_gradient_sync

    @property
    def requires_all_reduce(self) -> bool:
        """``set_requires_all_reduce``: whether replicate-group all-reduces run now."""
        return self._unit_state.options.requires_all_reduce

    @property
    def reshard_after_forward(self) -> bool | int:
        return self._unit_state.options.reshard_after_forward

    @property
    def root(self) -> RootView | None:
        """The root this unit belongs to (``None`` before the root's lazy init)."""
        ctx = self._unit_state.ctx
        return ctx.view if ctx is not None else None

    @property
    def stash(self) -> Stash:
        """Plugins' per-unit data."""
        return self._unit_state.stash

    def __repr__(self) -> str:
        return f"UnitView({self.fqn!r}, {len(self.params)} params)"


class RootView:
    """The root of a tree of units: what finalization phases receive."""

    __slots__ = ("_hyperfsdp_ctx",)

    def __init__(self, ctx: RootContext) -> None:
        self._hyperfsdp_ctx = ctx

    @property
    def unit(self) -> UnitView:
        """The root unit."""
        return self._hyperfsdp_ctx.root.view

    @property
    def units(self) -> tuple[UnitView, ...]:
        """Every unit under the root (the root first), in module order."""
        return self._hyperfsdp_ctx.unit_views

    @property
    def comm(self) -> PluginComm:
        """The communication facade (:class:`~hyperfsdp_core.plugin.PluginComm`)."""
        return self._hyperfsdp_ctx.plugin_comm

    @property
    def is_last_backward(self) -> bool:
        """``set_is_last_backward``: whether the optimizer step follows this backward
        (phases run after every backward either way)."""
        return self._hyperfsdp_ctx.is_last_backward

    @property
    def stash(self) -> Stash:
        """Plugins' per-root data. A value with a ``reset()`` method is reset by
        ``reset_iter_state()`` (drop in-flight work there)."""
        return self._hyperfsdp_ctx.stash

    def drain_reductions(self) -> None:
        """Finish every pending gradient reduction of this root, oldest first.

        During a backward each unit's post-backward issues its reduce-scatters and leaves
        them pending (a few stay in flight to overlap with the backward). For each pending
        post-backward this waits for its collectives, runs the unit's reducers
        (``hyperfsdp_gradient_reducers``) and lands on ``.grad`` what no reducer deferred
        or consumed. The core's ``core.reduce_scatter_drain`` phase
        (:data:`~hyperfsdp_core.plugin.FIRST_PHASE`) is this call, so later phases find
        nothing pending; a plugin may call it earlier (from a hook during the backward) to
        have the gradients reduced so far land now. With nothing pending it does nothing.
        Call it on the training thread, never from inside a reducer.
        """
        self._hyperfsdp_ctx.drain_reductions()

    def __repr__(self) -> str:
        return f"RootView({len(self.units)} units)"


def unit_of(module: nn.Module) -> UnitView | None:
    """The :class:`UnitView` of a module ``fully_shard`` was applied to, else ``None``."""
    state = getattr(module, "_hyperfsdp_state", None)
    return state.view if state is not None and module in state.modules else None
