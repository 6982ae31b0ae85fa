"""The tp plugin: FSDP and HSDP over tensor-parallel (DTensor) parameters.

* Validation (``hyperfsdp_validate_unit``): named meshes of one device type whose groups
  form grids (checked by ranks, wherever the meshes came from), no data-parallel dim reused
  by tensor parallelism, no ``Partial`` placements, at most one
  tensor-parallel replicate axis per parameter; every error names the FQNs.
* Topology and layout: FSDP shards each parameter's TP-local tensor on dim 0 (uneven sizes
  use the core's padded storage); the sharded parameter is a DTensor over the data-parallel
  dims followed by the TP dims, ``_StridedShard`` where both shard the same dim, so its
  global shape, ``full_tensor()`` and checkpoints are the logical parameter's.
* Gradients: plain tensors inside the engine (no ``redistribute``); TP-replicated
  parameters are summed over their TP group once per step, in the ``tp.replicate_all_reduce``
  phase after every data-parallel reduction (see ``_grads``).

Written against ``hyperfsdp_core.plugin`` only.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from hyperfsdp_core.plugin import (
    FIRST_PHASE,
    MeshInfo,
    ParamLayout,
    ParamView,
    Phase,
    RootView,
    StashKey,
    UnitSpec,
    UnitView,
    hookimpl,
)

from . import _spec
from ._grads import GradToLocal, TPReplicateGrads, WrapUnsharded, make_reducer

HYPERFSDP_API = ">=1.0,<2"
PHASE = "tp.replicate_all_reduce"
_QUEUE = StashKey[TPReplicateGrads]("tp.replicate_grads")


@hookimpl
def hyperfsdp_validate_unit(unit: UnitSpec) -> None:
    _spec.validate(unit)


@hookimpl
def hyperfsdp_select_mesh_info(unit: UnitSpec, fqn: str, param: nn.Parameter) -> MeshInfo | None:
    if not isinstance(param, DTensor) and unit.dp_mesh_dims is None:
        return None  # plain parameters: the core's (or the hsdp plugin's) topology
    return _spec.mesh_info_for(unit, param)


@hookimpl
def hyperfsdp_param_layout(
    unit: UnitSpec, fqn: str, param: nn.Parameter, mesh_info: MeshInfo, shard_dim: int
) -> ParamLayout | None:
    if not isinstance(param, DTensor):
        return None
    spec = _spec.spec_of(unit, param)
    shape, stride = param.shape, param.stride()
    return ParamLayout(
        tensor=param.to_local().detach(),  # FSDP shards the TP-local tensor
        mesh=spec.mesh,
        placements=_spec.sharded_placements(spec, mesh_info, shard_dim),
        global_shape=shape,
        global_stride=stride,
        wrap_unsharded=WrapUnsharded(spec, shape, stride),
        unwrap_grad=GradToLocal(fqn, spec),
    )


@hookimpl
def hyperfsdp_gradient_reducers(unit: UnitView):
    return make_reducer(unit, _QUEUE)


def _all_reduce(root: RootView) -> None:
    queue = root.stash.get(_QUEUE, None)
    if queue is not None:
        queue.all_reduce(root.unit.fqn)


@hookimpl
def hyperfsdp_finalize_phases():
    return [Phase(PHASE, _all_reduce, after=FIRST_PHASE, after_if_present=(_spec.DP_ALL_REDUCE,))]


@hookimpl
def hyperfsdp_plan_columns(param: ParamView):
    dims = _spec.tp_dims_of(param)
    if not dims:
        return None
    names = param.device_mesh.mesh_dim_names
    assert names is not None
    replicate = _spec.tp_replicate_dim(param)
    return {
        "tp_placement": ", ".join(f"{names[i]}:{param.placements[i]}" for i in dims),
        "tp_replicate_axis": names[replicate] if replicate is not None else None,
    }
