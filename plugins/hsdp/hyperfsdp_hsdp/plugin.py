"""The hsdp plugin: per-parameter HSDP/DDP topology and the data-parallel all-reduces.

Topology: a 2-D mesh ``(replicate, shard)`` gives HSDP mesh infos; parameters listed in
``replicate_params`` get a DDP mesh info over the whole data-parallel group. The core
then all-gathers and reduce-scatters over each parameter's shard group (or aliases the
local shard when the shard size is 1).

Reduction: after a unit's reduce-scatters finish, its reducer groups the reductions that
need an all-reduce by (process group, op, dtype, device) and launches one all-reduce per
group; the ``dp.all_reduce`` phase waits for all of them and applies the gradients.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hyperfsdp_core import hookimpl
from hyperfsdp_core._collectives import Comm, Handle
from hyperfsdp_core._mesh_info import MeshInfo, ddp_mesh_info, hsdp_mesh_info
from hyperfsdp_core._plugins import FIRST_PHASE, Phase
from hyperfsdp_core._reduction import Reduction
from hyperfsdp_core._unit import UnitSpec

PHASE = "dp.all_reduce"
_STASH = "hyperfsdp_hsdp"

_hsdp_infos: weakref.WeakKeyDictionary[DeviceMesh, MeshInfo] = weakref.WeakKeyDictionary()
_ddp_infos: weakref.WeakKeyDictionary[DeviceMesh, MeshInfo] = weakref.WeakKeyDictionary()
_flat_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


# -- topology -------------------------------------------------------------------------------------


@hookimpl
def hyperfsdp_validate_unit(unit: UnitSpec) -> None:
    if unit.dp_mesh_dims is None and unit.mesh.ndim > 2:
        raise ValueError(
            f"fully_shard: a {unit.mesh.ndim}-D mesh is not a data-parallel mesh; pass the "
            "(replicate, shard) sub-mesh, e.g. mesh=root_mesh['replicate', 'shard'], or "
            "dp_mesh_dims= with the tp plugin"
        )


@hookimpl
def hyperfsdp_select_mesh_info(unit: UnitSpec, fqn: str, param: nn.Parameter) -> MeshInfo | None:
    if isinstance(param, DTensor) or unit.dp_mesh_dims is not None:
        return None  # tensor-parallel layouts belong to the tp plugin
    mesh = unit.mesh
    if param in unit.replicate_params:
        return _ddp_info(mesh)
    if mesh.ndim == 2:
        info = _hsdp_infos.get(mesh)
        if info is None:
            info = _hsdp_infos[mesh] = hsdp_mesh_info(mesh)
        return info
    return None


def _ddp_info(mesh: DeviceMesh) -> MeshInfo:
    """Replicated over every rank of the data-parallel mesh (all R*S ranks under HSDP)."""
    info = _ddp_infos.get(mesh)
    if info is None:
        group = mesh.get_group(0) if mesh.ndim == 1 else _flat_group(mesh)
        info = _ddp_infos[mesh] = ddp_mesh_info(
            mesh, group, dist.get_world_size(group), dist.get_rank(group)
        )
    return info


def _flat_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    ranks = tuple(sorted(mesh.mesh.flatten().tolist()))
    group = _flat_groups.get(ranks)
    if group is None:
        if len(ranks) == dist.get_world_size():
            group = dist.group.WORLD
        else:  # only the mesh's ranks call fully_shard with it
            group = dist.new_group(list(ranks), use_local_synchronization=True)
        _flat_groups[ranks] = group
    return group


# -- reduction ------------------------------------------------------------------------------------


class _AllReduces:
    """One root's all-reduces in flight, and partial sums kept while all-reduce is off."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.in_flight: list[tuple[Handle, list[Reduction], torch.Tensor | None]] = []
        self.partial: dict[int, torch.Tensor] = {}  # id(bucket) -> summed reduce-scatter output

    def launch(self, group: dist.ProcessGroup, reductions: list[Reduction]) -> None:
        if len(reductions) == 1:
            flat = None
            tensor = reductions[0].output
        else:  # several buckets share the group: one collective over their concatenation
            flat = tensor = torch.cat([r.output for r in reductions])
        handle = self.comm.all_reduce(tensor, group, dist.ReduceOp.SUM)
        self.in_flight.append((handle, reductions, flat))

    def drain(self) -> None:
        in_flight, self.in_flight = self.in_flight, []
        for handle, reductions, flat in in_flight:
            handle.wait()
            if flat is not None:
                offset = 0
                for red in reductions:
                    n = red.output.numel()
                    red.output.copy_(flat[offset : offset + n])
                    offset += n
            for red in reductions:
                hook = red.bucket.all_reduce_hook
                if hook is not None:
                    hook(red.output)
                red.apply()

    def reset(self) -> None:
        for handle, _, _ in self.in_flight:
            handle.abandon()
        self.in_flight = []
        self.partial.clear()


def _queue(ctx) -> _AllReduces:
    queue = ctx.stash.get(_STASH)
    if queue is None:
        queue = ctx.stash[_STASH] = _AllReduces(ctx.comm)
    return queue


@hookimpl
def hyperfsdp_gradient_reducers(state):
    group = state.group
    if group is None or not any(b.mesh_info.replicate_size > 1 for b in group.buckets):
        return None

    def reduce(reductions: Sequence[Reduction]) -> None:
        queue = _queue(state.ctx)
        launch: dict[tuple, list[Reduction]] = {}
        for red in reductions:
            info = red.bucket.mesh_info
            if info.replicate_size <= 1:
                continue
            red.defer()
            key = id(red.bucket)
            partial = queue.partial.pop(key, None)
            if partial is not None:
                red.output.add_(partial)
            if not state.requires_all_reduce:  # accumulate reduce-scatter results only
                queue.partial[key] = red.output
                continue
            out = red.output
            launch.setdefault(
                (info.replicate_group, dist.ReduceOp.SUM, out.dtype, out.device), []
            ).append(red)
        for (pg, _, _, _), reds in launch.items():
            queue.launch(pg, reds)

    return reduce


def _drain(ctx) -> None:
    queue = ctx.stash.get(_STASH)
    if queue is not None:
        queue.drain()


@hookimpl
def hyperfsdp_finalize_phases():
    return [Phase(PHASE, _drain, after=(FIRST_PHASE,))]
