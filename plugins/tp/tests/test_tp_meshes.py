"""TP plugin: data-parallel and tensor-parallel meshes built every way torchtitan and users
build them, not only as slices of one root mesh (issue 28, item 4).

Each case builds a (dp, tp) pair of meshes, trains a Llama-like model parallelized on the TP
mesh (sequence parallelism, loss parallel head) and sharded with hyperfsdp on the
data-parallel mesh, next to the single-process reference on the global batch and, where
torch's FSDP2 accepts the meshes, next to FSDP2 on the same script: losses, gradient norms
and every parameter's ``full_tensor()`` must match (``hyperfsdp_tp.testing.train_parity``).
The sharded parameters' mesh must have the data-parallel groups on its leading dims and the
tensor-parallel groups on the others, and equal FSDP2's where FSDP2 runs.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from hyperfsdp_tp.testing import Transformer, parallelize, train_parity
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from hyperfsdp_core import fully_shard

TIMEOUT = 180


def _unflatten(dp, tp, replicate=1):
    """torchtitan 0.3.0's ``ParallelDims.build_mesh`` (legacy ``partial_dtensor`` path): a 1-D
    world mesh, unflattened once for data loading (whose ``tp`` TP uses) and once for the
    dense parameters (whose ``fsdp``, or ``dp_replicate, fsdp``, FSDP uses)."""
    world = init_device_mesh("cpu", (dp * tp,), mesh_dim_names=("world",))
    loading = world._unflatten(0, (1, dp, 1, tp), ("pp", "batch", "cp", "tp"))
    dense = world._unflatten(
        0, (1, replicate, dp // replicate, tp), ("pp", "dp_replicate", "fsdp", "tp")
    )
    dp_mesh = dense["dp_replicate", "fsdp"] if replicate > 1 else dense["fsdp"]
    return dp_mesh, loading["tp"]


def _flatten(dp, tp):
    """A data-parallel mesh flattened from two dims of an unflattened world mesh (as
    torchtitan's loss mesh is), the TP mesh sliced from that unflattened mesh."""
    world = init_device_mesh("cpu", (dp * tp,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (dp, 1, tp), ("batch", "cp", "tp"))
    return mesh["batch", "cp"]._flatten("batch_cp"), mesh["tp"]


def _separate_init(dp, tp):
    """Two ``init_device_mesh`` calls over the same ranks, one for each mesh."""
    a = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "a_tp"))
    b = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("b_dp", "tp"))
    return a["dp"], b["tp"]


def _explicit_grid(dp, tp):
    """The TP mesh from a root over an explicit rank tensor in another order (a rank map
    FSDP2 cannot concatenate with the data-parallel mesh's), with the same TP groups."""
    grid = torch.arange(dp * tp).view(dp, tp).T.contiguous()  # (tp, dp)
    b = DeviceMesh("cpu", grid, mesh_dim_names=("tp", "b_dp"))
    a = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "a_tp"))
    return a["dp"], b["tp"]


BUILDERS = {
    "unflatten": _unflatten,
    "unflatten_hsdp": lambda dp, tp: _unflatten(dp, tp, replicate=dp),
    "flatten": _flatten,
    "separate_init": _separate_init,
    "explicit_grid": _explicit_grid,
}
#: the cases torch's FSDP2 accepts (meshes over one rank map)
FSDP2_ACCEPTS = {"unflatten", "unflatten_hsdp", "flatten", "separate_init"}


def _group_ranks(mesh, dim):
    return dist.get_process_group_ranks(mesh.get_group(dim))


def rank_meshes(case, dp, tp):
    dp_mesh, tp_mesh = BUILDERS[case](dp, tp)
    dp_rank = dp_mesh.get_coordinate()
    dp_rank = dp_rank[0] if len(dp_rank) == 1 else dp_rank[0] * dp_mesh.size(1) + dp_rank[1]
    torch.manual_seed(0)
    model = Transformer()
    ref = copy.deepcopy(model)
    parallelize(model, tp_mesh, "sp", loss_parallel=True)
    models = [model]
    with_fsdp2 = case in FSDP2_ACCEPTS
    if with_fsdp2:
        models.append(parallelize(copy.deepcopy(ref), tp_mesh, "sp", loss_parallel=True))
    for m, shard in zip(models, (fully_shard, torch_fully_shard)):
        for block in m.layers:
            shard(block, mesh=dp_mesh)
        shard(m, mesh=dp_mesh)
    # the sharded parameters' mesh: the data-parallel groups, then the tensor-parallel ones
    mesh = model.layers[0].attn.wq.weight.device_mesh
    expected = [_group_ranks(dp_mesh, i) for i in range(dp_mesh.ndim)]
    expected += [_group_ranks(tp_mesh, 0)]
    groups = [_group_ranks(mesh, i) for i in range(mesh.ndim)]
    coordinates_ok = mesh.get_coordinate() == dp_mesh.get_coordinate() + tp_mesh.get_coordinate()
    same_as_fsdp2 = None
    if with_fsdp2:
        theirs = {n: p.device_mesh for n, p in models[1].named_parameters()}
        same_as_fsdp2 = all(p.device_mesh == theirs[n] for n, p in model.named_parameters())
    out = train_parity(models, ref, dp_rank, dp_mesh.size(), loss_parallel=True)
    return out, groups == expected, coordinates_ok, same_as_fsdp2


CASES = [pytest.param(4, case, (2, 2), id=f"world4-{case}") for case in BUILDERS] + [
    pytest.param(2, case, (1, 2), id=f"world2-{case}")
    for case in ("unflatten", "flatten", "separate_init", "explicit_grid")
]


@pytest.mark.parametrize("world,case,shape", CASES)
def test_meshes_of_any_origin_train_like_the_reference_and_fsdp2(run_ranks, world, case, shape):
    results = run_ranks(world, rank_meshes, case, *shape, timeout=TIMEOUT)
    for rank, (out, groups_ok, coordinates_ok, same_as_fsdp2) in enumerate(results):
        assert groups_ok, (rank, "the sharded mesh's groups are not the dp and tp groups")
        assert coordinates_ok, (rank, "the sharded mesh's coordinates are not (dp..., tp...)")
        assert len(out["losses"][0]) == 3
        if case in FSDP2_ACCEPTS:
            ours, fsdp2 = out["losses"]
            assert ours == pytest.approx(fsdp2, rel=1e-5), (ours, fsdp2)
            assert same_as_fsdp2
        else:
            assert len(out["losses"]) == 1
