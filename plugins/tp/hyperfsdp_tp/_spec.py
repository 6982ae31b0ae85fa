"""Where a DTensor parameter lives: its tensor-parallel spec, its data-parallel topology, and
the checks ``fully_shard`` runs on them.

Two ways to call ``fully_shard`` with DTensor parameters (as in FSDP2):

* *TP mesh*: ``parallelize_module(model, root_mesh["tp"], plan)`` then
  ``fully_shard(model, mesh=root_mesh["dp"])`` (or ``root_mesh["dp_replicate", "dp_shard"]``
  for HSDP). The sharded parameter's mesh is the data-parallel dims followed by the TP dims
  (:func:`join_meshes`); the two meshes need not share a root, their groups must form grids.
* *full mesh*: ``fully_shard(model, mesh=root_mesh, dp_mesh_dims=DataParallelMeshDims(...))``
  with parameters that are DTensors on ``root_mesh`` itself, ``Replicate()`` on the named
  data-parallel dims. The sharded parameter stays on ``root_mesh``.

Either way a parameter is described by a :class:`TPSpec`; the rest of the plugin does not
care which way it came.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from hyperfsdp_core.plugin import (
    MeshInfo,
    ParamView,
    ProcessGroupCache,
    UnitSpec,
    ddp_mesh_info,
    fsdp_mesh_info,
    get_plugin_manager,
    hsdp_mesh_info,
)

from ._torch_private import (
    concatenate,
    is_strided_shard,
    rank_groups,
    root_mesh,
    same_rank_map,
    strided_shard,
)

#: The hsdp plugin's phase: it all-reduces over data-parallel replicate groups.
DP_ALL_REDUCE = "dp.all_reduce"


@attrs.frozen(eq=False)
class TPSpec:
    """One DTensor parameter before sharding.

    ``compute_mesh``/``compute_placements``: the parameter's own DTensor spec, what the
    module computes with (the TP mesh, or the full mesh under ``dp_mesh_dims``);
    ``tp_dims``: the indices of its tensor-parallel dims in ``compute_placements``.
    ``mesh``/``placements``: the same spec extended to the data-parallel dims, with
    ``Replicate()`` on them; the sharded parameter lives on ``mesh``.
    """

    compute_mesh: DeviceMesh = attrs.field(eq=False)
    compute_placements: tuple[Placement, ...]
    tp_dims: tuple[int, ...]
    mesh: DeviceMesh = attrs.field(eq=False)
    placements: tuple[Placement, ...]


def spec_of(unit: UnitSpec, param: DTensor) -> TPSpec:
    """The :class:`TPSpec` of a (validated) DTensor parameter of ``unit``."""
    compute_mesh, compute = param.device_mesh, tuple(param.placements)
    if unit.dp_mesh_dims is not None:  # the parameter is on the full mesh already
        dp = set(_dp_names(unit))
        names = compute_mesh.mesh_dim_names or ()
        tp_dims = tuple(i for i, name in enumerate(names) if name not in dp)
        return TPSpec(compute_mesh, compute, tp_dims, compute_mesh, compute)
    dp_mesh = unit.mesh
    mesh = join_meshes(dp_mesh, tp_mesh_of(dp_mesh, compute_mesh))  # validated
    placements = (Replicate(),) * dp_mesh.ndim + compute
    return TPSpec(compute_mesh, compute, tuple(range(len(compute))), mesh, placements)


# -- joining a data-parallel mesh and a tensor-parallel mesh --------------------------------------


class MeshMismatch(ValueError):
    """Why a data-parallel mesh and a tensor-parallel mesh cannot be joined (no FQNs)."""


_joined_meshes: ProcessGroupCache[DeviceMesh] = ProcessGroupCache()


def tp_mesh_of(dp_mesh: DeviceMesh, param_mesh: DeviceMesh) -> DeviceMesh:
    """The tensor-parallel mesh to join: the slice of ``dp_mesh``'s root mesh with the
    parameter's mesh dims where that equals ``param_mesh``, else ``param_mesh``.

    A DTensor's ``device_mesh`` may be an equal mesh object of another, earlier root (DTensor
    caches specs by value), holding that root's process groups (e.g. gloo where the user put
    the TP dim on another backend); the sibling slice holds the groups the user meant.
    """
    root = root_mesh(dp_mesh)
    names = param_mesh.mesh_dim_names
    if names is None or root.mesh_dim_names is None or not set(names) <= set(root.mesh_dim_names):
        return param_mesh
    try:
        sliced = root[names] if len(names) > 1 else root[names[0]]
    except (KeyError, RuntimeError, ValueError):  # e.g. names not in the root's order
        return param_mesh
    return sliced if sliced == param_mesh else param_mesh


def join_meshes(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The (dp..., tp...) mesh the sharded parameters live on, one object per pair (DTensors on
    it compare equal cheaply); :class:`MeshMismatch` if the two meshes' groups are no grid.

    Validated by ranks, not by where the meshes came from: slices of one root, ``_flatten``,
    ``_unflatten`` (torchtitan), separate ``init_device_mesh`` calls or explicit rank grids all
    qualify when their groups form a grid (see :func:`_grid`). Meshes over one rank map are
    joined as FSDP2 joins them (equal meshes); others get a mesh over this rank's grid made
    from the two meshes' own process groups.
    """
    return _joined_meshes.setdefault((dp_mesh, tp_mesh), lambda: _join(dp_mesh, tp_mesh))


def _join(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    grid = _grid(dp_mesh, tp_mesh)
    if same_rank_map(dp_mesh, tp_mesh):
        try:
            joined = concatenate([dp_mesh, tp_mesh])
        except RuntimeError:  # torch's own layout check; the grid check says when it holds
            pass
        else:
            if torch.equal(joined.mesh, grid):
                return joined
    groups = [*dp_mesh.get_all_groups(), *tp_mesh.get_all_groups()]
    names = (*(dp_mesh.mesh_dim_names or ()), *(tp_mesh.mesh_dim_names or ()))
    return DeviceMesh.from_group(groups, dp_mesh.device_type, mesh=grid, mesh_dim_names=names)


def _grid(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> torch.Tensor:
    """This rank's block of global ranks, shaped ``(*dp_mesh.shape, *tp_mesh.shape)``.

    Checks, for every block (so that every rank raises alike), that the data-parallel groups
    and the tensor-parallel groups tile the same ranks as grids: in each block, the tensor-
    parallel group of the rank at data-parallel coordinate ``a`` holds, at each tensor-parallel
    coordinate ``b``, the rank at coordinate ``a`` of the data-parallel group of column ``b``.
    Then each data-parallel group meets each tensor-parallel group of its block in exactly one
    rank, and every data-parallel group holds ranks of one tensor-parallel coordinate (the
    ranks whose TP-local tensors FSDP shards together are the same TP shard).
    """
    dp_groups = [tuple(g) for g in rank_groups(dp_mesh).tolist()]
    tp_groups = [tuple(g) for g in rank_groups(tp_mesh).tolist()]
    dp_at, tp_at = _coordinates(dp_groups), _coordinates(tp_groups)
    if dp_at.keys() != tp_at.keys():
        raise MeshMismatch(
            f"the data-parallel mesh covers ranks {_listing(dp_at)} but the tensor-parallel mesh "
            f"covers ranks {_listing(tp_at)}; both must cover the same ranks (a mesh made by "
            "DeviceMesh.from_group from one process group knows only that group's ranks: build "
            "both meshes over the whole rank grid, with init_device_mesh and slicing, _flatten or "
            "_unflatten, or DeviceMesh.from_group with every group and the full mesh)"
        )
    me, done, mine = dist.get_rank(), set(), None
    for rank in sorted(dp_at):
        if rank in done:
            continue
        column = dp_groups[dp_at[rank][0]]
        row = tp_groups[tp_at[rank][0]]
        shared = sorted(set(column) & set(row))
        if len(shared) > 1:
            raise MeshMismatch(
                f"data-parallel group {list(column)} and tensor-parallel group {list(row)} share "
                f"ranks {shared}; FSDP must shard over other ranks than tensor parallelism. Pass "
                "the data-parallel mesh (e.g. root_mesh['dp']) orthogonal to the tensor-parallel "
                "one (root_mesh['tp'])"
            )
        block = [tp_groups[tp_at[x][0]] for x in column]
        for a, ranks in enumerate(block):
            for b, y in enumerate(ranks):
                want = dp_groups[dp_at[row[b]][0]]
                got, at = dp_groups[dp_at[y][0]], dp_at[y][1]
                if got != want or at != a:
                    raise MeshMismatch(
                        "the data-parallel and tensor-parallel groups do not form a grid: rank "
                        f"{y} is at tensor-parallel coordinate {b} (group {list(ranks)}), so it "
                        f"must be at data-parallel coordinate {a} of group {list(want)}, but it "
                        f"is at coordinate {at} of group {list(got)}. Each data-parallel group "
                        "must hold the ranks of one tensor-parallel coordinate: build both meshes "
                        "from one rank grid, e.g. init_device_mesh(device, (dp, tp), "
                        "mesh_dim_names=('dp', 'tp')) and its ['dp'] and ['tp']"
                    )
        done.update(y for ranks in block for y in ranks)
        if me in done and mine is None:
            mine = block
    if mine is None:
        raise MeshMismatch(f"this rank ({me}) is in neither mesh")
    return torch.tensor(mine, dtype=torch.int).reshape(*dp_mesh.shape, *tp_mesh.shape)


def _coordinates(groups: list[tuple[int, ...]]) -> dict[int, tuple[int, int]]:
    """rank -> (index of its group, its coordinate in it)."""
    return {rank: (i, c) for i, group in enumerate(groups) for c, rank in enumerate(group)}


def _listing(ranks: Iterable[int], most: int = 16) -> str:
    ranks = sorted(ranks)
    shown = ", ".join(map(str, ranks[:most]))
    return f"[{shown}{', ...' if len(ranks) > most else ''}] ({len(ranks)})"


def sharded_placements(spec: TPSpec, mesh_info: MeshInfo, shard_dim: int) -> tuple[Placement, ...]:
    """The sharded parameter's placements on ``spec.mesh``.

    FSDP shards the TP-local tensor on ``shard_dim``: ``Shard(shard_dim)`` on the shard mesh
    dim, unless tensor parallelism shards the same dim on a later mesh dim, in which case
    FSDP's split is the inner one: ``_StridedShard(shard_dim, split_factor=<TP shards>)``.
    """
    placements = list(spec.placements)
    if mesh_info.kind == "DDP" or mesh_info.shard_mesh_dim is None:
        return tuple(placements)
    assert mesh_info.mesh.mesh_dim_names is not None and spec.mesh.mesh_dim_names is not None
    shard_name = mesh_info.mesh.mesh_dim_names[mesh_info.shard_mesh_dim]
    k = spec.mesh.mesh_dim_names.index(shard_name)
    split = math.prod(
        spec.mesh.size(j)
        for j in range(k + 1, spec.mesh.ndim)
        if _shards_dim(placements[j], shard_dim)
    )
    placements[k] = strided_shard(shard_dim, split) if split > 1 else Shard(shard_dim)
    return tuple(placements)


def _shards_dim(placement: Placement, dim: int) -> bool:
    return placement.is_shard(dim) or (is_strided_shard(placement) and placement.dim == dim)


# -- what a ParamView tells about tensor parallelism ------------------------------------------


def tp_dims_of(param: ParamView) -> list[int]:
    """Indices of the tensor-parallel dims of a managed parameter's mesh (``[]``: none)."""
    names = param.device_mesh.mesh_dim_names
    dp = param.mesh_info.mesh.mesh_dim_names
    if names is None or dp is None or param.device_mesh.ndim == param.mesh_info.mesh.ndim:
        return []
    return [i for i, name in enumerate(names) if name not in dp]


def tp_replicate_dim(param: ParamView) -> int | None:
    """The TP mesh dim (of more than one rank) the parameter is replicated over, if any."""
    for i in tp_dims_of(param):
        if param.placements[i].is_replicate() and param.device_mesh.size(i) > 1:
            return i
    return None


# -- data-parallel topology -----------------------------------------------------------------------

_fsdp_infos: ProcessGroupCache[MeshInfo] = ProcessGroupCache()
_hsdp_infos: ProcessGroupCache[MeshInfo] = ProcessGroupCache()
_ddp_infos: ProcessGroupCache[MeshInfo] = ProcessGroupCache()
_dp_meshes: ProcessGroupCache[DeviceMesh] = ProcessGroupCache()
_flat_groups: ProcessGroupCache[dist.ProcessGroup] = ProcessGroupCache()


def mesh_info_for(unit: UnitSpec, param: nn.Parameter) -> MeshInfo:
    dp_mesh = data_parallel_mesh(unit)
    dims = unit.dp_mesh_dims
    if param in unit.replicate_params or (dims is not None and not dims.shard_names):
        return _ddp_infos.setdefault(dp_mesh, lambda: _ddp_info(dp_mesh))
    if dp_mesh.ndim == 1:
        return _fsdp_infos.setdefault(dp_mesh, lambda: fsdp_mesh_info(dp_mesh))
    return _hsdp_infos.setdefault(dp_mesh, lambda: hsdp_mesh_info(dp_mesh))


def data_parallel_mesh(unit: UnitSpec) -> DeviceMesh:
    """The data-parallel mesh: ``mesh`` itself, or (``dp_mesh_dims``) its (replicate, shard)
    dims, in that order."""
    dims = unit.dp_mesh_dims
    if dims is None:
        return unit.mesh
    mesh = unit.mesh
    names = (*dims.replicate_names, *dims.shard_names)

    def make() -> DeviceMesh:
        if len(names) == 1:
            return mesh[names[0]]
        return concatenate([mesh[name] for name in names])

    return _dp_meshes.setdefault((mesh, names), make)


def _ddp_info(dp_mesh: DeviceMesh) -> MeshInfo:
    """Replicated over every rank of the data-parallel mesh (all R*S ranks of a 2-D one)."""
    if dp_mesh.ndim == 1:
        group = dp_mesh.get_group(0)
    else:
        ranks = tuple(sorted(dp_mesh.mesh.flatten().tolist()))
        # only the data-parallel mesh's ranks call fully_shard with it
        group = _flat_groups.setdefault(
            ranks, lambda: dist.new_group(list(ranks), use_local_synchronization=True)
        )
    return ddp_mesh_info(dp_mesh, group, dist.get_world_size(group), dist.get_rank(group))


def _dp_names(unit: UnitSpec) -> tuple[str, ...]:
    dims = unit.dp_mesh_dims
    if dims is not None:
        return (*dims.replicate_names, *dims.shard_names)
    return tuple(unit.mesh.mesh_dim_names or ())


# -- validation -----------------------------------------------------------------------------------


def validate(unit: UnitSpec) -> None:
    """Reject DTensor units the plugin cannot shard correctly; every error names the FQNs."""
    if unit.dp_mesh_dims is not None:
        _validate_full_mesh(unit)
        return
    params = [(fqn, p) for fqn, p in unit.named_params if isinstance(p, DTensor)]
    if not params or len(params) != len(unit.named_params) or unit.mesh_was_default:
        return  # no DTensors, or a mix / mesh=None: the core's checks name those
    mesh = unit.mesh
    if mesh.mesh_dim_names is None:
        raise ValueError(
            "fully_shard: the data-parallel mesh has unnamed dims, but tensor-parallel "
            f"parameters ({_fqns(params)}) need one named root mesh for both. Build it with "
            "names, e.g. root_mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', "
            "'tp')), apply parallelize_module on root_mesh['tp'] and pass mesh=root_mesh['dp']"
        )
    _check_meshes(mesh, params)
    _check_placements(params, lambda p: range(p.device_mesh.ndim))
    _check_common(unit, params, mesh.ndim == 2)


def _check_meshes(dp_mesh: DeviceMesh, params: list[tuple[str, DTensor]]) -> None:
    dp_names = set(dp_mesh.mesh_dim_names or ())
    unnamed = [(f, p) for f, p in params if p.device_mesh.mesh_dim_names is None]
    if unnamed:
        raise ValueError(
            f"fully_shard: tensor-parallel parameters {_fqns(unnamed)} are on a mesh with "
            "unnamed dims; build the root mesh with mesh_dim_names (e.g. ('dp', 'tp')) and "
            "apply parallelize_module on root_mesh['tp']"
        )
    devices = [(f, p) for f, p in params if p.device_mesh.device_type != dp_mesh.device_type]
    if devices:
        kinds = sorted({p.device_mesh.device_type for _, p in devices})
        raise ValueError(
            f"fully_shard: the data-parallel mesh is on {dp_mesh.device_type!r} but "
            f"tensor-parallel parameters {_fqns(devices)} are on a {'/'.join(kinds)!r} mesh; "
            "slice both meshes from one root mesh of one device type"
        )
    reused = [(f, p) for f, p in params if dp_names & set(p.device_mesh.mesh_dim_names)]
    if reused:
        dims = sorted(dp_names & {n for _, p in reused for n in p.device_mesh.mesh_dim_names})
        raise ValueError(
            f"fully_shard: mesh dim(s) {dims} of the data-parallel mesh are also tensor-parallel "
            f"dims of parameters {_fqns(reused)}; FSDP must shard over other dims than tensor "
            "parallelism. Pass the data-parallel sub-mesh, e.g. mesh=root_mesh['dp'], not "
            "root_mesh['tp']"
        )
    failures: dict[DeviceMesh, tuple[MeshMismatch, list[str]]] = {}
    for fqn, p in params:
        mesh = p.device_mesh
        if mesh in failures:
            failures[mesh][1].append(fqn)
            continue
        try:
            join_meshes(dp_mesh, tp_mesh_of(dp_mesh, mesh))
        except MeshMismatch as exc:
            failures[mesh] = (exc, [fqn])
    if failures:
        mesh, (exc, fqns) = next(iter(failures.items()))
        raise ValueError(
            f"fully_shard: the data-parallel mesh {dp_mesh.mesh_dim_names} and the tensor-parallel "
            f"mesh {mesh.mesh_dim_names} of parameters {', '.join(map(repr, fqns))} cannot be "
            f"joined into one (data-parallel, tensor-parallel) mesh: {exc}"
        ) from None


def _check_placements(params: list[tuple[str, DTensor]], tp_dims) -> None:
    partial = [(f, p) for f, p in params if any(pl.is_partial() for pl in p.placements)]
    if partial:
        raise ValueError(
            f"fully_shard: parameters {_fqns(partial)} have Partial placements "
            f"({', '.join(str(tuple(p.placements)) for _, p in partial)}); a parameter must be "
            "Shard or Replicate on every tensor-parallel dim. Redistribute them to Replicate() "
            "(or Shard) before fully_shard"
        )
    multi = []
    for fqn, p in params:
        names = p.device_mesh.mesh_dim_names or ()
        axes = [
            names[i]
            for i in tp_dims(p)
            if p.placements[i].is_replicate() and p.device_mesh.size(i) > 1
        ]
        if len(axes) > 1:
            multi.append(f"{fqn} (replicated over {', '.join(map(repr, axes))})")
    if multi:
        raise ValueError(
            "fully_shard: parameters replicated over several independent tensor-parallel mesh "
            f"dims would each need a gradient all-reduce over every one of them: "
            f"{'; '.join(multi)}. Shard them over all but one of those dims, or flatten the dims "
            "into one before parallelize_module"
        )


def _check_common(unit: UnitSpec, params: list[tuple[str, DTensor]], replicated: bool) -> None:
    raf = unit.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool):
        raise ValueError(
            f"fully_shard: reshard_after_forward={raf} (an int) is not supported with "
            f"tensor-parallel parameters ({_fqns(params)}); pass True or False"
        )
    if (replicated or unit.replicate_params) and not _has_phase(DP_ALL_REDUCE):
        raise ImportError(
            "fully_shard: tensor-parallel parameters with a data-parallel replicate dim (HSDP) "
            "or replicate_params need the hyperfsdp-hsdp plugin to all-reduce their gradients: "
            "pip install hyperfsdp[hsdp]"
        )


def _has_phase(name: str) -> bool:
    return any(phase.name == name for phase in get_plugin_manager().finalization_phases())


def _validate_full_mesh(unit: UnitSpec) -> None:
    dims, mesh = unit.dp_mesh_dims, unit.mesh
    assert dims is not None
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "fully_shard: dp_mesh_dims needs a mesh with named dims (init_device_mesh(..., "
            "mesh_dim_names=(...))); it names the data-parallel dims of that mesh"
        )
    wanted = (*dims.replicate_names, *dims.shard_names)
    missing = [n for n in wanted if n not in names]
    if missing:
        raise ValueError(
            f"fully_shard: dp_mesh_dims names {missing}, which the mesh {names} does not have"
        )
    if (
        len(dims.shard_names) > 1
        or len(dims.replicate_names) > 1
        or len(set(wanted)) != len(wanted)
    ):
        raise ValueError(
            f"fully_shard: dp_mesh_dims={dims!r}: name one shard dim and at most one replicate "
            "dim (distinct); flatten several data-parallel dims into one mesh dim first"
        )
    plain = [(f, p) for f, p in unit.named_params if not isinstance(p, DTensor)]
    if plain:
        listing = ", ".join(f"{f} ({type(p).__name__})" for f, p in plain)
        raise ValueError(
            f"fully_shard: with dp_mesh_dims every parameter must be a DTensor on the full mesh "
            f"{names}, with Replicate() on the data-parallel dims; got plain tensors: {listing}. "
            "Distribute them first (distribute_tensor / distribute_module)"
        )
    params = list(unit.named_params)
    elsewhere = [(f, p) for f, p in params if p.device_mesh != mesh]
    if elsewhere:
        raise ValueError(
            f"fully_shard: parameters {_fqns(elsewhere)} are DTensors on another mesh than the "
            f"one passed with dp_mesh_dims ({names}); with dp_mesh_dims, pass the parameters' "
            "own full mesh, or use mesh=root_mesh['dp'] without dp_mesh_dims"
        )
    dp_idx = [names.index(n) for n in wanted]
    not_replicated = [
        f"{f} {tuple(p.placements)}"
        for f, p in params
        if any(not p.placements[i].is_replicate() for i in dp_idx)
    ]
    if not_replicated:
        raise ValueError(
            f"fully_shard: with dp_mesh_dims the parameters must be Replicate() on the "
            f"data-parallel dims {list(wanted)}; got {'; '.join(not_replicated)}"
        )
    tp = [i for i in range(mesh.ndim) if i not in dp_idx]
    _check_placements(params, lambda p: tp)
    _check_common(unit, params, bool(dims.replicate_names))


def _fqns(params: Iterable[tuple[str, object]]) -> str:
    return ", ".join(repr(f) for f, _ in params)
