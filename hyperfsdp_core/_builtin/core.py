"""The core's own plugin: input validation, 1-D mesh topology, the reduce-scatter drain."""

from __future__ import annotations

import weakref

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .._mesh_info import MeshInfo, fsdp_mesh_info
from .._plugins import FIRST_PHASE, Phase, hookimpl
from .._unit import UnitSpec
from ..policies import CPUOffloadPolicy

_mesh_infos: weakref.WeakKeyDictionary[DeviceMesh, MeshInfo] = weakref.WeakKeyDictionary()


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
    if isinstance(unit.offload_policy, CPUOffloadPolicy) and not _has_plugin("offload"):
        raise _need_plugin("CPUOffloadPolicy", "offload")
    raf = unit.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool):
        shard = unit.mesh.size(unit.mesh.ndim - 1)
        if not (1 < raf < shard and shard % raf == 0):
            raise ValueError(
                f"reshard_after_forward={raf}: an int must be a divisor of the shard mesh size "
                f"({shard}) other than 1 and {shard}; use True/False otherwise"
            )


def _has_plugin(name: str) -> bool:
    from .._plugins import get_plugin_manager

    return get_plugin_manager().get_plugin(name) is not None


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
    info = _mesh_infos.get(mesh)
    if info is None:
        info = _mesh_infos[mesh] = fsdp_mesh_info(mesh)
    return info


def _drain(ctx) -> None:
    ctx.drain_reductions()


@hookimpl
def hyperfsdp_finalize_phases():
    return [Phase(FIRST_PHASE, _drain)]
