"""The only place the tp plugin touches private PyTorch APIs; each use says why.

Everything else is written against public APIs. If a use here breaks on a new torch
release, this module is the one to adapt.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement
from torch.distributed.tensor.placement_types import _StridedShard


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself for a root mesh).

    FSDP's data-parallel mesh and the tensor-parallel mesh must be sibling slices of one
    named root mesh, so that their dims can be joined into the sharded parameters' mesh;
    a sub-mesh can tell its root only through this private method.
    """
    return mesh._get_root_mesh()


def concatenate(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are the given sibling meshes' dims, in that order.

    The sharded parameter is a DTensor over the data-parallel dims followed by the
    tensor-parallel dims. Slicing the root by name (public) needs the names in the root's
    order; FSDP2 builds the same mesh with this private method, which takes any order.
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
