"""Frozen descriptions of a parameter's data-parallel topology.

A MeshInfo says over which ranks a parameter is sharded (the shard group) and over
which ranks its gradient is additionally all-reduced (the replicate group). It holds
no tensors, dtypes or work handles; parameters with the same topology share one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

V = TypeVar("V")


class ProcessGroupCache(Generic[V]):
    """A cache of objects made from process groups (groups, meshes, MeshInfos).

    Process groups belong to one c10d world (the default process group and the groups
    made under it): ``dist.destroy_process_group()`` ends it, a later
    ``init_process_group`` starts another. Values are kept per world, so a lookup never
    hands back a group of another world: of an earlier initialization, or of another
    rank where ranks are threads of one process (torch's threaded process group, whose
    default group is per thread). A world's values are dropped once it is replaced: when
    a thread that used it moves on to another world, or the thread that first used it
    has ended and another world is in use.
    """

    def __init__(self) -> None:
        # id(world) -> (weak reference to the world, the thread that first used it, values)
        self._worlds: dict[int, tuple[weakref.ref, weakref.ref, dict[Hashable, V]]] = {}
        self._thread = threading.local()  # .world: the id of the world this thread last used
        self._lock = threading.Lock()

    def _current(self) -> dict[Hashable, V]:
        world = dist.group.WORLD if dist.is_initialized() else None
        if world is None:  # no world: nothing to keep values for
            return {}
        key = id(world)
        last = getattr(self._thread, "world", None)
        entry = self._worlds.get(key)
        if last == key and entry is not None and entry[0]() is world:
            return entry[2]
        with self._lock:
            if last is not None and last != key:
                self._worlds.pop(last, None)  # this thread's previous world is over
            entry = self._worlds.get(key)
            if entry is None or entry[0]() is not world:
                self._drop_stale()
                entry = self._worlds[key] = (
                    weakref.ref(world),
                    weakref.ref(threading.current_thread()),
                    {},
                )
        self._thread.world = key
        return entry[2]

    def _drop_stale(self) -> None:
        """Forget worlds that are gone, or whose first thread has ended (the calling
        thread, in another world, no longer shares them)."""
        for key, (world, thread, _) in list(self._worlds.items()):
            owner = thread()
            if world() is None or owner is None or not owner.is_alive():
                del self._worlds[key]

    @classmethod
    def _key(cls, key: Hashable) -> Hashable:
        # DeviceMeshes compare equal by layout and dimension names; two such meshes can
        # still hold different process groups (another backend, ``backend_override``),
        # so a mesh stands for itself and its groups, also inside a tuple key
        if isinstance(key, DeviceMesh):
            return (key, tuple(key.get_all_groups()))
        if isinstance(key, tuple):
            return tuple(cls._key(k) for k in key)
        return key

    def get(self, key: Hashable) -> V | None:
        return self._current().get(self._key(key))

    def setdefault(self, key: Hashable, factory: Callable[[], V]) -> V:
        """The value under ``key``, made by ``factory()`` (maybe collective) if missing.
        A ``DeviceMesh`` in the key stands for its layout and its process groups."""
        key = self._key(key)
        data = self._current()
        value = data.get(key)
        if value is None:
            value = data[key] = factory()
        return value

    def __len__(self) -> int:
        return len(self._current())


def _group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group)) if group is not None else ()


@attrs.frozen(eq=False)
class MeshInfo:
    """Common fields; use one of the three kinds below."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup | None
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None = None
    replicate_size: int = 1
    replicate_rank: int = 0
    shard_mesh_dim: int | None = None
    replicate_mesh_dim: int | None = None
    kind: str = "FSDP"
    key: tuple = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(
            self,
            "key",
            (self.kind, _group_ranks(self.shard_group), _group_ranks(self.replicate_group)),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshInfo) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def needs_all_gather(self) -> bool:
        return self.shard_size > 1

    @property
    def device(self) -> torch.device:
        return mesh_device(self.mesh)

    @property
    def dp_size(self) -> int:
        """Total data-parallel degree: gradients are averaged over this many ranks."""
        return self.shard_size * self.replicate_size

    def describe(self) -> str:
        return f"{self.kind}(shard={self.shard_size}, replicate={self.replicate_size})"


def fsdp_mesh_info(mesh: DeviceMesh) -> MeshInfo:
    """Fully sharded over a 1-D mesh."""
    if mesh.ndim != 1:
        raise ValueError(f"fsdp_mesh_info expects a 1-D mesh, got {mesh.ndim}-D")
    return MeshInfo(
        mesh=mesh,
        shard_group=mesh.get_group(0),
        shard_size=mesh.size(0),
        shard_rank=mesh.get_local_rank(0),
        shard_mesh_dim=0,
        kind="FSDP",
    )


def hsdp_mesh_info(mesh: DeviceMesh) -> MeshInfo:
    """Sharded over mesh dim 1, replicated over mesh dim 0."""
    if mesh.ndim != 2:
        raise ValueError(f"hsdp_mesh_info expects a 2-D mesh, got {mesh.ndim}-D")
    return MeshInfo(
        mesh=mesh,
        shard_group=mesh.get_group(1),
        shard_size=mesh.size(1),
        shard_rank=mesh.get_local_rank(1),
        replicate_group=mesh.get_group(0),
        replicate_size=mesh.size(0),
        replicate_rank=mesh.get_local_rank(0),
        shard_mesh_dim=1,
        replicate_mesh_dim=0,
        kind="HSDP",
    )


def ddp_mesh_info(mesh: DeviceMesh, group: dist.ProcessGroup, size: int, rank: int) -> MeshInfo:
    """Not sharded; gradients all-reduced over ``group`` (the whole data-parallel group)."""
    return MeshInfo(
        mesh=mesh,
        shard_group=None,
        shard_size=1,
        shard_rank=0,
        replicate_group=group,
        replicate_size=size,
        replicate_rank=rank,
        kind="DDP",
    )


def check_mesh_device(mesh: DeviceMesh, what: str) -> None:
    """A mesh must live on a device its process groups can communicate on (``meta`` has no
    collective backend: the error would otherwise come at the first forward)."""
    if mesh.device_type == "meta":
        raise ValueError(
            f"fully_shard({what}): the mesh {mesh!r} is on the 'meta' device, which cannot "
            "run collectives. Build the mesh on the device you train on, e.g. "
            "init_device_mesh('cuda', (world_size,)) or init_device_mesh('cpu', "
            "(world_size,)); the module's parameters may stay on meta until "
            "model.to_empty(device=...)"
        )


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh communicates on: the current device for accelerators, else CPU."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type, None)
    if module is not None and hasattr(module, "current_device"):
        return torch.device(mesh.device_type, module.current_device())
    return torch.device(mesh.device_type)


_post_forward_infos: ProcessGroupCache[MeshInfo] = ProcessGroupCache()


def post_forward_mesh_info(info: MeshInfo, size: int) -> MeshInfo:
    """The group a parameter is resharded to after forward when ``reshard_after_forward=size``.

    Splits every shard group of ``info``'s mesh into consecutive blocks of ``size`` ranks
    (for example the ranks of one node), on a 2-D mesh ``(blocks, size)``. Collective:
    every rank must call it in the same order (``fully_shard`` does). Cached per topology.
    """
    return _post_forward_infos.setdefault((info.key, size), lambda: _post_forward(info, size))


def _post_forward(info: MeshInfo, size: int) -> MeshInfo:
    assert info.shard_mesh_dim is not None
    # (blocks, size), as FSDP2's post-forward mesh: dim 1 holds the ranks that gather
    # together in backward; between forward and backward the parameters are DTensors on
    # it with (Replicate(), Shard(d))
    ranks = info.mesh.mesh.movedim(info.shard_mesh_dim, -1).reshape(-1, size)
    mesh = DeviceMesh(info.mesh.device_type, ranks)
    return MeshInfo(
        mesh=mesh,
        shard_group=mesh.get_group(1),
        shard_size=size,
        shard_rank=mesh.get_local_rank(1),
        shard_mesh_dim=1,
        kind=info.kind,
    )


_separate_groups: ProcessGroupCache[dist.ProcessGroup] = ProcessGroupCache()


def separate_group(info: MeshInfo) -> dist.ProcessGroup:
    """A second process group over ``info``'s shard ranks, for reduce-scatters.

    With its own communicator (its own gloo threads on CPU) a reduce-scatter need not
    queue behind an all-gather on the shard group. Collective for those ranks on first
    use; cached per rank set.
    """
    ranks = dist.get_process_group_ranks(info.shard_group)
    return _separate_groups.setdefault(
        tuple(ranks), lambda: dist.new_group(ranks, use_local_synchronization=True)
    )
