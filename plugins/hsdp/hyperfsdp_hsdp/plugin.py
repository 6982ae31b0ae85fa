"""The hsdp plugin: per-parameter HSDP/DDP topology and the data-parallel all-reduces.

Topology: a 2-D mesh ``(replicate, shard)`` gives HSDP mesh infos; parameters listed in
``replicate_params`` get a DDP mesh info over the whole data-parallel group. The core
then all-gathers and reduce-scatters over each parameter's shard group (or aliases the
local shard when the shard size is 1).

Reduction: after a unit's reduce-scatters finish, its reducer defers the reductions that
need an all-reduce, groups them by (process group, op, dtype, device) and launches one
SUM all-reduce per group; the ``dp.all_reduce`` phase waits for all of them, divides each
result by the reduction's ``all_reduce_divisor`` (the replicate size by default: FSDP2's
average, bit for bit) and releases the reductions, which then land on the parameters'
gradients (unless another plugin, e.g. tensor parallelism, still holds them). Written
against ``hyperfsdp_core.plugin`` only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hyperfsdp_core.plugin import (
    FIRST_PHASE,
    MeshInfo,
    Phase,
    PluginComm,
    ProcessGroupCache,
    Reduction,
    RootView,
    StashKey,
    UnitSpec,
    UnitView,
    Work,
    ddp_mesh_info,
    hookimpl,
    hsdp_mesh_info,
)

HYPERFSDP_API = ">=1.0,<2"
PHASE = "dp.all_reduce"

_hsdp_infos: ProcessGroupCache[MeshInfo] = ProcessGroupCache()
_ddp_infos: ProcessGroupCache[MeshInfo] = ProcessGroupCache()
_flat_groups: ProcessGroupCache[dist.ProcessGroup] = ProcessGroupCache()


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
        return _hsdp_infos.setdefault(mesh, lambda: hsdp_mesh_info(mesh))
    return None


def _ddp_info(mesh: DeviceMesh) -> MeshInfo:
    """Replicated over every rank of the data-parallel mesh (all R*S ranks under HSDP)."""

    def make() -> MeshInfo:
        group = mesh.get_group(0) if mesh.ndim == 1 else _flat_group(mesh)
        return ddp_mesh_info(mesh, group, dist.get_world_size(group), dist.get_rank(group))

    return _ddp_infos.setdefault(mesh, make)


def _flat_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    ranks = tuple(sorted(mesh.mesh.flatten().tolist()))

    def make() -> dist.ProcessGroup:
        if len(ranks) == dist.get_world_size():
            return dist.group.WORLD
        # only the mesh's ranks call fully_shard with it
        return dist.new_group(list(ranks), use_local_synchronization=True)

    return _flat_groups.setdefault(ranks, make)


# -- reduction ------------------------------------------------------------------------------------


class _AllReduces:
    """One root's all-reduces in flight, and partial sums kept while all-reduce is off."""

    def __init__(self, comm: PluginComm) -> None:
        self.comm = comm
        self.in_flight: list[tuple[Work, list[Reduction], torch.Tensor | None]] = []
        #: Reduction.key -> (the reduction holding the summed reduce-scatter outputs of
        #: backwards with all-reduce off, its unit); held until all-reduce is on again
        self.partial: dict[tuple, tuple[Reduction, UnitView]] = {}

    def launch(self, group: dist.ProcessGroup, reductions: list[Reduction]) -> None:
        if len(reductions) == 1:
            flat = None
            tensor = reductions[0].output
        else:  # several buckets share the group: one collective over their concatenation
            flat = tensor = torch.cat([r.output for r in reductions])
        work = self.comm.all_reduce(tensor, group, dist.ReduceOp.SUM, unit=reductions[0].unit.fqn)
        self.in_flight.append((work, reductions, flat))

    def drain(self) -> None:
        in_flight, self.in_flight = self.in_flight, []
        for work, reductions, flat in in_flight:
            work.wait()
            if flat is not None:
                offset = 0
                for red in reductions:
                    n = red.output.numel()
                    red.output.copy_(flat[offset : offset + n])
                    offset += n
            for red in reductions:
                if red.all_reduce_divisor is not None:  # FSDP2's average over the replicas
                    red.output.div_(red.all_reduce_divisor)
                red.release()

    def launch_grouped(self, reductions: Sequence[Reduction]) -> None:
        """One all-reduce per (replicate group, op, dtype, device) over ``reductions``."""
        launch: dict[tuple, list[Reduction]] = {}
        for red in reductions:
            out = red.output
            key = (red.mesh_info.replicate_group, dist.ReduceOp.SUM, out.dtype, out.device)
            launch.setdefault(key, []).append(red)
        for (pg, _, _, _), reds in launch.items():
            self.launch(pg, reds)

    def flush(self) -> None:
        """All-reduce the partial sums of units whose all-reduce is on again (a backward
        that gave them no new gradient, or ``reduce_grads()``), then release them."""
        ready = [key for key, (_, unit) in self.partial.items() if unit.requires_all_reduce]
        if ready:
            self.launch_grouped([self.partial.pop(key)[0] for key in ready])
            self.drain()

    def reset(self) -> None:
        for work, _, _ in self.in_flight:
            work.abandon()  # recovering from a failed iteration: the result is dropped
        self.in_flight = []
        self.partial.clear()


_QUEUE = StashKey[_AllReduces]("hsdp.all_reduces")


@hookimpl
def hyperfsdp_gradient_reducers(unit: UnitView):
    if not any(p.replicate_size > 1 for p in unit.params):
        return None

    def reduce(reductions: Sequence[Reduction]) -> None:
        root = unit.root
        assert root is not None
        queue = root.stash.setdefault(_QUEUE, lambda: _AllReduces(root.comm))
        launch = []
        for red in reductions:
            if red.mesh_info.replicate_size <= 1:
                continue
            held = queue.partial.pop(red.key, None)
            if held is not None:  # earlier backwards' sums join this one; that one never lands
                red.output.add_(held[0].consume())
                held[0].release()
            red.defer()  # released by the dp.all_reduce phase once all-reduced
            if unit.requires_all_reduce:
                launch.append(red)
            else:  # accumulate reduce-scatter results only
                queue.partial[red.key] = (red, unit)
        queue.launch_grouped(launch)

    return reduce


def _drain(root: RootView) -> None:
    queue = root.stash.get(_QUEUE, None)
    if queue is not None:
        queue.drain()
        queue.flush()


@hookimpl
def hyperfsdp_finalize_phases():
    return [Phase(PHASE, _drain, after=(FIRST_PHASE,))]
