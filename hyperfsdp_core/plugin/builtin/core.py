"""The core's own plugin: input validation, 1-D mesh topology, the default parameter layout,
gradient landing and load conversion, and the reduce-scatter drain phase.

Written like any third-party plugin: it uses only the public plugin API
(``hyperfsdp_core.plugin``), which ``tests/test_public_api.py`` checks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hyperfsdp_core.plugin import (
    FIRST_PHASE,
    MeshInfo,
    ParamLayout,
    ParamView,
    Phase,
    ProcessGroupCache,
    RootView,
    UnitSpec,
    UnitView,
    fsdp_mesh_info,
    hookimpl,
    placements_for,
)

_mesh_infos: ProcessGroupCache[MeshInfo] = ProcessGroupCache()


def _need_plugin(what: str, extra: str) -> ImportError:
    return ImportError(f"{what} needs the hyperfsdp-{extra} plugin: pip install hyperfsdp[{extra}]")


@hookimpl
def hyperfsdp_validate_unit(unit: UnitSpec) -> None:
    plain = [(fqn, p) for fqn, p in unit.named_params if not isinstance(p, DTensor)]
    dtensor = [(fqn, p) for fqn, p in unit.named_params if isinstance(p, DTensor)]
    if plain and dtensor:
        listing = lambda ps: ", ".join(f"{fqn} ({type(p).__name__})" for fqn, p in ps)  # noqa: E731
        raise ValueError(
            "fully_shard: a unit's parameters must be all plain Tensors or all DTensors, got "
            f"plain=[{listing(plain)}] and DTensor=[{listing(dtensor)}]. Apply tensor "
            "parallelism to every parameter of the unit, or shard the plain ones in a separate unit"
        )
    if dtensor and unit.mesh_was_default:
        raise ValueError(
            "fully_shard: DTensor (tensor-parallel) parameters need an explicit data-parallel "
            f"mesh ({', '.join(fqn for fqn, _ in dtensor)}); pass mesh=root_mesh['dp'] (a "
            "sibling of the TP mesh dim in the same named root mesh)"
        )
    raf = unit.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool):
        shard = unit.mesh.size(unit.mesh.ndim - 1)
        if not (1 < raf < shard and shard % raf == 0):
            raise ValueError(
                f"reshard_after_forward={raf}: an int must be a divisor of the shard mesh size "
                f"({shard}) other than 1 and {shard}; use True/False otherwise"
            )


@hookimpl(trylast=True)
def hyperfsdp_select_mesh_info(unit: UnitSpec, fqn: str, param: nn.Parameter) -> MeshInfo:
    if isinstance(param, DTensor):
        raise _need_plugin(f"parameter {fqn!r} is a DTensor (tensor parallel); that", "tp")
    if param in unit.replicate_params:
        raise _need_plugin(f"replicate_params (parameter {fqn!r})", "hsdp")
    mesh = unit.mesh
    if unit.dp_mesh_dims is not None:
        raise _need_plugin("dp_mesh_dims", "tp")
    if mesh.ndim != 1:
        raise _need_plugin(f"a {mesh.ndim}-D mesh (HSDP)", "hsdp")
    return _mesh_infos.setdefault(mesh, lambda: fsdp_mesh_info(mesh))


@hookimpl(trylast=True)
def hyperfsdp_param_layout(
    unit: UnitSpec, fqn: str, param: nn.Parameter, mesh_info: MeshInfo, shard_dim: int
) -> ParamLayout:
    return ParamLayout(
        tensor=param.detach(),
        mesh=mesh_info.mesh,
        placements=placements_for(mesh_info, shard_dim),
        global_shape=tuple(param.shape),
    )


def _to_storage(param: ParamView, shard: torch.Tensor) -> torch.Tensor:
    device = param.sharded_param.device
    if shard.device == device:
        return shard
    # blocking: the core casts or adds the result at once (asynchronous copies need a plugin
    # that waits for them, as the offload plugin does)
    return shard.to(device)


@hookimpl(trylast=True)
def hyperfsdp_grad_landing(unit: UnitView):
    if any(p.sharded_param.device != unit.device for p in unit.params):
        return _to_storage
    return None


@hookimpl(trylast=True)
def hyperfsdp_load_convert(param: ParamView, value: torch.Tensor) -> torch.Tensor | None:
    if isinstance(value, DTensor) or tuple(value.shape) != param.global_shape:
        return None  # the core's validation names what it expected
    # every rank holds the full tensor: take this rank's shard, no communication
    local = distribute_tensor(
        value.detach().to(param.sharded_param.device),
        param.device_mesh,
        param.placements,
        src_data_rank=None,
    )
    return local


def _drain(root: RootView) -> None:
    root.drain_reductions()


@hookimpl
def hyperfsdp_finalize_phases():
    return [Phase(FIRST_PHASE, _drain)]
