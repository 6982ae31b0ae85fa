"""ShardedParam: one managed parameter's three layers and who owns its unsharded memory.

* logical global tensor: the model's parameter, never padded (``global_shape``); FSDP
  shards a plain tensor of ``unsharded_shape`` (the parameter itself, or under tensor
  parallelism its TP-local tensor, as the ``hyperfsdp_param_layout`` hook decides);
* actual shard: this rank's ``torch.chunk`` rows of that tensor, the DTensor's local
  tensor (``sharded_param``), what the optimizer and checkpoints see;
* padded communication slot: ``layout.padded_shape`` elements inside its bucket's
  flat sharded buffer; the actual shard is a prefix view of it and the padding
  (only for uneven shapes) stays zero.

The flat buffers themselves belong to the :class:`~hyperfsdp_core.engine.bucket.Bucket`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from .._torch_private import dtensor_around, dtensor_from_local_fast, dtensor_local_tensor
from .extension import extension_of
from .layout import ShardLayout, contiguous_strides
from .mesh_info import MeshInfo
from .port import PluginPort
from .records import ParamLayout
from .stash import Stash


class StorageOwner(str, enum.Enum):
    """Who owns the memory behind a parameter's unsharded view; reshard frees only what it owns."""

    SHARDED_STORAGE = "sharded_storage"  # aliases the sharded buffer: never freed, never copied
    CAST_BUFFER = "cast_buffer"  # a compute-dtype cast of the sharded buffer (no all-gather)
    ALL_GATHER_OUTPUT = "all_gather_output"  # the all-gather writes straight into it
    FUSED_BUFFER = "fused_buffer"  # the bucket's unsharded buffer, filled by copy-out

    def __str__(self) -> str:
        return self.value


class ShardedParam:
    """State of one managed parameter. Plugins see it as a ``ParamView`` (``view``, built by the plugin layer)."""

    def __init__(
        self,
        fqn: str,
        param: nn.Parameter,
        layout: ParamLayout,
        module_infos: list[tuple[nn.Module, str]],
        mesh_info: MeshInfo,
        shard_dim: int,
        port: PluginPort,
    ) -> None:
        self.fqn = fqn
        self.orig_param_id = id(param)  # identity of the Parameter fully_shard replaced
        self.module_infos = module_infos
        self.mesh_info = mesh_info
        self.shard_dim = shard_dim
        # the plain tensor FSDP shards and all-gathers back (see ParamLayout)
        self.unsharded_shape = tuple(layout.tensor.shape)
        self.unsharded_stride = contiguous_strides(self.unsharded_shape)
        # the sharded DTensor's spec
        self.global_shape = layout.global_shape
        self.global_stride = layout.global_stride
        self.dtensor_mesh = layout.mesh
        self.placements = layout.placements
        self.wrap_unsharded = layout.wrap_unsharded
        # FSDP2's tensor-subclass all-gather extension (``engine/extension_payload.py``)
        self.extension = extension_of(fqn, layout.tensor, shard_dim)
        self.unwrap_grad = layout.unwrap_grad
        self.orig_dtype = param.dtype
        self.param_dtype: torch.dtype = param.dtype
        self.reduce_dtype: torch.dtype = param.dtype
        self.layout = ShardLayout(
            self.unsharded_shape, shard_dim, world=mesh_info.shard_size, rank=mesh_info.shard_rank
        )
        # hot-path copies of the (immutable) layout facts
        self.actual_shape = self.layout.actual_shape
        self.actual_numel = self.layout.actual_numel
        self.stash = Stash()
        self.view = port.param_view(self)  # what plugins are handed (built above the engine)
        self.storage_owner = StorageOwner.SHARDED_STORAGE
        # where reduced gradient shards land (hyperfsdp_grad_landing), set at lazy init
        self.land_grad: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
        self.sharded_param: nn.Parameter = param  # replaced by the DTensor in install_sharded
        self.padded_slot: torch.Tensor | None = None  # its slot in the bucket's flat buffer
        # whether sharded_param is the DTensor install_sharded made (the parameter it
        # replaces may itself be a DTensor: a tensor-parallel one)
        self.installed = False
        self.unsharded_param: nn.Parameter | None = None
        # Gradient kept across backwards with gradient sync disabled (reduce dtype).
        self.accumulated_grad: torch.Tensor | None = None

    def set_dtypes(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
        """The compute and reduce dtypes a ``hyperfsdp_param_dtypes`` answer gives (``None``:
        the original dtype, and the compute dtype for reductions)."""
        self.param_dtype = param_dtype or self.orig_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype

    def retype(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
        """The registered parameter's dtype changed (``model.to(dtype)``): it is the original
        dtype now, the others as decided again; a gradient kept with sync off follows."""
        self.orig_dtype = self.sharded_param.dtype
        self.set_dtypes(param_dtype, reduce_dtype)
        acc = self.accumulated_grad  # gradient kept with sync off, in the reduce dtype
        if acc is not None and acc.dtype != self.reduce_dtype:
            self.accumulated_grad = acc.to(self.reduce_dtype)

    def gained_extension(self) -> bool:
        """Whether this parameter, not an extension parameter until now, is one: its
        sharded local tensor (``param._local_tensor``) was given ``fsdp_pre_all_gather``
        and ``fsdp_post_all_gather`` since ``fully_shard``, as instance attributes or
        through its class (FSDP2 looks them up on that tensor at every all-gather)."""
        return not self.extension and self.decide_extension()

    def decide_extension(self) -> bool:
        """Whether the sharded local tensor uses the all-gather extension now, with the
        checks and errors of ``fully_shard``; after a storage rebuild (``to_empty``,
        ``load_state_dict(assign=True)``) the local tensor is a new object, without the
        methods a user attached to the old one (as in FSDP2, attach them again)."""
        local = dtensor_local_tensor(self.sharded_param)
        self.extension = extension_of(self.fqn, local, self.shard_dim)
        return self.extension

    def rename(self, fqn: str) -> None:
        """Its name relative to the root (known at the root's lazy init)."""
        self.fqn = fqn

    def land_grads_through(self, land: Callable[[Any, torch.Tensor], torch.Tensor] | None) -> None:
        """``land(view, local)`` transforms each reduced shard before it lands
        (``hyperfsdp_grad_landing``, resolved at lazy init)."""
        self.land_grad = land

    def adopt(self, registered: nn.Parameter) -> None:
        """``registered`` (a load with ``assign=True``, a re-assignment) is the sharded
        parameter from now on."""
        self.sharded_param = registered

    def set_unsharded(self, param: nn.Parameter | None, owner: StorageOwner | None = None) -> None:
        """The unsharded parameter its bucket built (``None``: none yet), and who owns its
        memory (unchanged when not given)."""
        self.unsharded_param = param
        if owner is not None:
            self.storage_owner = owner

    # -- facts -------------------------------------------------------------------------------
    @property
    def needs_all_gather(self) -> bool:
        return self.mesh_info.shard_size > 1

    @property
    def requires_grad(self) -> bool:
        return self.sharded_param.requires_grad

    @property
    def device(self) -> torch.device:
        return self.sharded_param.device

    def local_shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's actual shard of a tensor of the unsharded shape."""
        lay = self.layout
        return full.narrow(self.shard_dim, lay.offset, lay.actual_len)

    # -- registration on modules -------------------------------------------------------------
    def install_sharded(self, local: torch.Tensor, slot: torch.Tensor) -> None:
        """Make ``sharded_param`` a DTensor around ``local`` (a view of the bucket's buffer),
        the actual shard at the front of ``slot`` (its padded communication slot).

        The Parameter object stays the same across calls (optimizers hold it): the first
        call creates it, later calls swap the new contents into it.
        """
        self.padded_slot = slot
        dt = dtensor_around(
            local,
            self.dtensor_mesh,
            self.placements,
            torch.Size(self.global_shape),
            tuple(self.global_stride),
        )
        new = nn.Parameter(dt, requires_grad=self.sharded_param.requires_grad)
        if self.installed:
            grad = self.sharded_param.grad
            self.sharded_param.grad = None
            torch.utils.swap_tensors(self.sharded_param, new)
            self.sharded_param.grad = grad
        else:
            self.sharded_param = new
            self.installed = True
        self.to_sharded()

    def to_sharded(self) -> None:
        self._register(self.sharded_param)

    def to_post_forward(self, param: nn.Parameter) -> None:
        """Register ``param``, the DTensor on the post-forward mesh (reshard_after_forward=<int>)."""
        if param.requires_grad != self.sharded_param.requires_grad:
            param.requires_grad_(self.sharded_param.requires_grad)
        self._register(param)

    def to_unsharded(self) -> None:
        unsharded = self.unsharded_param
        assert unsharded is not None
        if unsharded.requires_grad != self.sharded_param.requires_grad:
            unsharded.requires_grad_(self.sharded_param.requires_grad)
        self._register(unsharded)

    def _register(self, param: nn.Parameter) -> None:
        for module, name in self.module_infos:
            # Skip nn.Module.__setattr__'s checks (hot path) unless the class overrides it.
            if type(module).__setattr__ is nn.Module.__setattr__:
                module._parameters[name] = param
            else:
                setattr(module, name, param)

    def registered(self) -> nn.Parameter:
        module, name = self.module_infos[0]
        return module._parameters[name]

    # -- gradients -----------------------------------------------------------------------------
    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The gradient accumulated on the unsharded parameter (and sync-off accumulation)."""
        unsharded = self.unsharded_param
        grad = unsharded.grad if unsharded is not None else None
        if grad is not None:
            unsharded.grad = None
            if self.unwrap_grad is not None:
                grad = self.unwrap_grad(grad)
        acc = self.accumulated_grad
        if acc is not None:
            self.accumulated_grad = None
            if grad is not None:
                acc.add_(grad)
            return acc
        return grad

    def keep_unsharded_grad(self) -> None:
        """Gradient sync is off: keep accumulating (in the reduce dtype if it differs)."""
        unsharded = self.unsharded_param
        if unsharded is None or unsharded.grad is None:
            return
        if self.reduce_dtype == unsharded.dtype and self.accumulated_grad is None:
            return  # autograd keeps accumulating into unsharded.grad
        grad = unsharded.grad
        unsharded.grad = None
        if self.unwrap_grad is not None:
            grad = self.unwrap_grad(grad)
        if self.accumulated_grad is None:
            self.accumulated_grad = grad.to(self.reduce_dtype)
        else:
            self.accumulated_grad.add_(grad)

    def apply_sharded_grad(self, local: torch.Tensor) -> None:
        """Add (or set) this rank's reduced gradient shard on the sharded parameter."""
        if self.land_grad is not None:
            local = self.land_grad(self.view, local)
        if local.dtype != self.orig_dtype:
            local = local.to(self.orig_dtype)
        param = self.sharded_param
        existing = param.grad
        if existing is None:
            param.grad = dtensor_from_local_fast(local, param)
        else:
            existing.to_local().add_(local)

    def clear_iteration_grads(self) -> None:
        if self.unsharded_param is not None:
            self.unsharded_param.grad = None
        self.accumulated_grad = None

    def __repr__(self) -> str:
        return f"ShardedParam({self.fqn!r}, {self.global_shape}, {self.mesh_info.describe()})"


def placements_for(mesh_info: MeshInfo, shard_dim: int) -> tuple:  # the core's default layout
    """DTensor placements of a parameter with this topology."""
    ndim = mesh_info.mesh.ndim
    if mesh_info.kind == "DDP":
        return (Replicate(),) * ndim
    placements: list = [Replicate()] * ndim
    assert mesh_info.shard_mesh_dim is not None
    placements[mesh_info.shard_mesh_dim] = Shard(shard_dim)
    return tuple(placements)
