"""The only place the tp plugin touches private PyTorch APIs; each use says why.

Everything else is written against public APIs. If a use here breaks on a new torch
release, this module is the one to adapt.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement
from torch.distributed.tensor.placement_types import _StridedShard


def rank_groups(mesh: DeviceMesh) -> torch.Tensor:
    """Every group of ``mesh``, one row each: shape ``(groups, mesh.size())``, each row the
    global ranks of one group in the mesh's (row-major) coordinate order.

    The data-parallel and tensor-parallel meshes are validated by their ranks (each data-
    parallel group must meet each tensor-parallel group of its block in one rank, at matching
    coordinates), the same way on every rank, so every rank needs the other ranks' groups
    too. A mesh knows them (its layout over its rank map), but publicly it only shows the
    current rank's group (``mesh.mesh``). A mesh made by ``DeviceMesh.from_group`` from one
    group knows that group only, and gives that single row.
    """
    return mesh._layout.remap_to_tensor(mesh._rank_map).reshape(-1, mesh.size())


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced, flattened or unflattened from (itself for a root mesh).

    Only to prefer the tensor-parallel mesh the user sliced from the data-parallel mesh's
    root over an equal mesh object DTensor may hand back instead (see ``_spec.tp_mesh_of``);
    a sub-mesh can tell its root only through this private method.
    """
    return mesh._get_root_mesh()


def same_rank_map(a: DeviceMesh, b: DeviceMesh) -> bool:
    """Whether two meshes index one rank map (e.g. both come from ``init_device_mesh`` over
    the world, by slicing, ``_flatten`` or ``_unflatten``): ``concatenate`` needs that."""
    return a._flatten_rank_map == b._flatten_rank_map


def concatenate(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are the given meshes' dims, in that order (meshes over one rank
    map, with orthogonal layouts: see ``same_rank_map``).

    The sharded parameter is a DTensor over the data-parallel dims followed by the
    tensor-parallel dims. FSDP2 builds that mesh with this private method, which also joins
    meshes of different roots (torchtitan unflattens its world mesh several times) and sub-
    meshes of one root in any order; the result equals FSDP2's mesh.
    """
    return DeviceMesh._concatenate(list(meshes))


def strided_shard(dim: int, split_factor: int) -> Placement:
    """FSDP's placement when tensor parallelism shards the same dim on a later mesh dim.

    FSDP shards the TP-local tensor, i.e. *inside* each TP shard, while DTensor's plain
    ``Shard`` on an earlier mesh dim means the outer split. ``_StridedShard`` (private,
    used by FSDP2 for the same purpose) states the inner split, so the global shape,
    ``full_tensor()`` and checkpoint offsets are right, uneven sizes included.
    """
    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement: Placement) -> bool:
    return isinstance(placement, _StridedShard)
