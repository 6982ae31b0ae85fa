"""TP plugin: parity with a single-process reference on the global batch (world 4, gloo).

Each run trains a Llama-like block stack parallelized with ``parallelize_module`` on
``root_mesh["tp"]`` and sharded with hyperfsdp, next to the unsharded reference (and, where
said, next to torch's FSDP2 on the same script), with SGD and gradient clipping: gradient
norms before and after clipping and every parameter's ``full_tensor()`` must match the
reference to fp32 tolerance (``hyperfsdp_tp.testing.train_parity``).
"""

import copy

import pytest
import torch
from hyperfsdp_shm import register_shm_backend  # hyperfsdp-shm, installed by `make install`
from hyperfsdp_tp.testing import Transformer, full, parallelize, train_parity
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from hyperfsdp_core import DataParallelMeshDims, fully_shard
from hyperfsdp_core.testing.counting import CollectiveCounter

TIMEOUT = 180


#: the root mesh of this rank's last ``rank_parity`` run
LAST_MESH = {}


def meshes(shape, tp_backend=None):
    """(root mesh, data-parallel mesh, dp rank, dp size) for (dp, tp) or (rep, shard, tp);
    ``tp_backend``: the tp dimension's c10d backend (default: the default group's, gloo),
    on a mesh named ("data", "tp"): DTensor takes meshes of equal layout and names for one
    (its caches keep the first one's groups), so a second backend needs other names."""
    if len(shape) == 2:
        if tp_backend:
            names, override = ("data", "tp"), {"tp": tp_backend}
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names, backend_override=override)
            return mesh, mesh["data"], mesh.get_local_rank("data"), shape[0]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        return mesh, mesh["dp"], mesh.get_local_rank("dp"), shape[0]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    dp = mesh["dp_replicate", "dp_shard"]
    rank = mesh.get_local_rank("dp_replicate") * shape[1] + mesh.get_local_rank("dp_shard")
    return mesh, dp, rank, shape[0] * shape[1]


def shard(model, dp_mesh, fully_shard_fn=fully_shard, **kwargs):
    for block in model.layers:
        fully_shard_fn(block, mesh=dp_mesh, **kwargs)
    fully_shard_fn(model, mesh=dp_mesh, **kwargs)
    return model


def rank_parity(variant, shape, with_fsdp2, tp_backend=None, **model_kwargs):
    mesh, dp, dp_rank, dp_size = meshes(shape, tp_backend)
    LAST_MESH["mesh"] = mesh
    torch.manual_seed(0)
    model = Transformer(**model_kwargs)
    ref = copy.deepcopy(model)
    models = [model]
    loss_parallel = variant == "sp"
    parallelize(model, mesh["tp"], variant, loss_parallel=loss_parallel)
    shard(model, dp)
    if with_fsdp2:
        torch.manual_seed(0)
        other = parallelize(copy.deepcopy(ref), mesh["tp"], variant, loss_parallel=loss_parallel)
        models.append(shard(other, dp, torch_fully_shard))
    with CollectiveCounter() as counter:
        out = train_parity(
            models,
            ref,
            dp_rank,
            dp_size,
            loss_parallel=loss_parallel,
            vocab=model_kwargs.get("vocab", 32),
        )
    placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    return out, placements, local, counter.count("ag")


def strided(split):
    """What FSDP's dim-0 placement looks like where TP shards dim 0 too (_StridedShard)."""
    return f"_StridedShard(dim=0, sf={split})"


@pytest.mark.parametrize("variant", ["sp", "no_sp", "no_sp_dtensor"])
def test_tp_fsdp_parity_and_fsdp2_losses(run_ranks, variant):
    """dp=2, tp=2: with sequence parallelism (Partial norm gradients, loss parallel head) and
    without it (norm gradients Replicate or Partial); losses equal torch FSDP2's."""
    for out, placements, _, _ in run_ranks(4, rank_parity, variant, (2, 2), True, timeout=TIMEOUT):
        ours, fsdp2 = out["losses"]
        assert ours == pytest.approx(fsdp2, rel=1e-5), (ours, fsdp2)
        assert ours == pytest.approx(out["ref_losses"], rel=2e-2)  # local batches vs global
        assert repr(placements["layers.0.attn.wq.weight"][0]) == strided(2)
        assert placements["layers.0.attn.wq.weight"][1] == Shard(0)  # colwise
        assert placements["layers.0.attn.wo.weight"] == (Shard(0), Shard(1))  # rowwise
        assert placements["layers.0.attn_norm.weight"] == (Shard(0), Replicate())
        assert repr(placements["tok_embeddings.weight"][0]) == strided(2)


def rank_parity_shm_tp():
    """The sequence-parallel run twice: the tp group on gloo, then on ``hyperfsdp_shm``."""
    gloo = rank_parity("sp", (2, 2), True)
    shm = rank_parity("sp", (2, 2), True, tp_backend=register_shm_backend())
    tp_group = LAST_MESH["mesh"].get_group("tp")
    return gloo[0]["losses"], shm[0]["losses"], type(tp_group).__name__, tp_group.transport.ops


def test_tp_on_the_shm_backend_equals_gloo_bit_for_bit(run_ranks):
    """The tp dimension on ``hyperfsdp_shm``: DTensor's sequence-parallel all-gathers and
    reduce-scatters go through shared memory; hyperfsdp's and FSDP2's losses are the gloo
    run's exactly (and the reference's, asserted in train_parity)."""
    for on_gloo, on_shm, group_type, ops in run_ranks(4, rank_parity_shm_tp, timeout=TIMEOUT):
        assert on_shm == on_gloo  # [hyperfsdp losses, FSDP2 losses], bit for bit
        assert group_type == "ShmProcessGroup" and ops > 0


def test_hsdp_tp_parity_without_all_gather(run_ranks):
    """HSDP + TP, (replicate 2, shard 1, tp 2): shard size 1 takes the no-all-gather path."""
    for out, placements, _, gathers in run_ranks(
        4, rank_parity, "sp", (2, 1, 2), True, timeout=TIMEOUT
    ):
        ours, fsdp2 = out["losses"]
        assert ours == pytest.approx(fsdp2, rel=1e-5)
        assert gathers == 0
        wq = placements["layers.0.attn.wq.weight"]
        assert (wq[0], repr(wq[1]), wq[2]) == (Replicate(), strided(2), Shard(0))  # as FSDP2
        assert placements["norm.weight"] == (Replicate(), Shard(0), Replicate())


def test_tp_local_uneven_dim0(run_ranks):
    """Vocabulary 37 and MLP hidden 26 over tp=2: TP-local dim-0 sizes 19/18 and 13, each then
    sharded unevenly over dp=2 (10/9, 9/9, 7/6) with the core's padded storage."""
    kwargs = {"vocab": 37, "hidden": 26}
    results = run_ranks(4, rank_parity, "no_sp", (2, 2), False, timeout=TIMEOUT, **kwargs)
    for out, placements, _, _ in results:
        assert len(out["losses"][0]) == 3
        assert repr(placements["output.weight"][0]) == strided(2)
    # ranks (dp, tp) = 00, 01, 10, 11: TP-local rows 19 / 18, then dp chunks of 10 rows
    assert [r[2]["output.weight"] for r in results] == [(10, 16), (9, 16), (9, 16), (9, 16)]
    assert [r[2]["layers.0.mlp.w1.weight"] for r in results] == [(7, 16), (7, 16), (6, 16), (6, 16)]


# -- RFC example C: global (10, 2), dp=2, tp=2, both shard dim 0 ---------------------------------


def rank_example_c():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Linear(2, 10, bias=False)  # weight (10, 2)
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
    fully_shard(model, mesh=mesh["dp"])
    weight = model.weight
    local = weight.to_local()
    rows = [int(r) for r in (local[:, 0] == ref.weight[:, 0].unsqueeze(1)).nonzero()[:, 0]]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    torch.testing.assert_close(model.weight.full_tensor(), ref.weight.detach())
    # as the core's load conversion does it (torch's scatter path rejects uneven strided shards)
    again = distribute_tensor(
        ref.weight.detach(), weight.device_mesh, weight.placements, src_data_rank=None
    )
    return (
        repr(tuple(weight.placements)),
        tuple(local.shape),
        rows,
        torch.equal(again.to_local(), model.weight.to_local()),
    )


def test_example_c_strided_uneven_layout(run_ranks):
    """RFC §7.7 example C: actual shapes 3/3/2/2 at global row offsets 0/5/3/8, placements
    (_StridedShard(0, split_factor=2), Shard(0)); full_tensor() equals the reference after
    training and distribute_tensor() of the reference gives the same local shards."""
    results = run_ranks(4, rank_example_c, timeout=TIMEOUT)
    expected = [((3, 2), [0, 1, 2]), ((3, 2), [5, 6, 7]), ((2, 2), [3, 4]), ((2, 2), [8, 9])]
    for (placements, shape, rows, same), (want_shape, want_rows) in zip(results, expected):
        assert placements == f"({strided(2)}, Shard(dim=0))"
        assert (shape, rows) == (want_shape, want_rows)
        assert same


# -- the full mesh with dp_mesh_dims ------------------------------------------------------------


class SPMDMLP(nn.Module):
    """Parameters are DTensors on the full (dp, tp) mesh: Replicate() on dp."""

    def __init__(self, mesh) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(12, 8) * 0.3)
        self.w2 = nn.Parameter(torch.randn(8, 12) * 0.3)
        self.scale = nn.Parameter(torch.rand(8) + 0.5)
        self.mesh = mesh

    def distribute(self):
        m = self.mesh
        self.w1 = nn.Parameter(distribute_tensor(self.w1.detach(), m, (Replicate(), Shard(0))))
        self.w2 = nn.Parameter(distribute_tensor(self.w2.detach(), m, (Replicate(), Shard(1))))
        self.scale = nn.Parameter(
            distribute_tensor(self.scale.detach(), m, (Replicate(), Replicate()))
        )
        return self

    def forward(self, x):
        h = torch.relu(x @ self.w1.T) @ self.w2.T
        return h * self.scale


#: torch FSDP2's own ``DataParallelMeshDims`` (torch 2.13 and later), the comparison's other side
TORCH_DP_MESH_DIMS = getattr(torch.distributed.fsdp, "DataParallelMeshDims", None)


def rank_dp_mesh_dims():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(shard="dp")
    ref = SPMDMLP(mesh)
    ours, summed, theirs = (copy.deepcopy(ref).distribute() for _ in range(3))
    fully_shard(ours, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(summed, mesh=mesh, dp_mesh_dims=dims)
    summed.set_gradient_divide_factor(1.0)
    # FSDP2 wants the parameters' own mesh object; DTensor's spec cache may have handed them
    # an equal mesh of an earlier test in this process (hyperfsdp compares meshes by value)
    spmd = theirs.w1.device_mesh
    assert all(p.device_mesh is spmd for p in theirs.parameters())
    if TORCH_DP_MESH_DIMS is not None:
        torch_fully_shard(theirs, mesh=spmd, dp_mesh_dims=TORCH_DP_MESH_DIMS(shard="dp"))
    dp = mesh.get_local_rank("dp")
    results = []
    for model in (ours, summed, theirs, ref):
        if model is theirs and TORCH_DP_MESH_DIMS is None:
            results.append(None)
            continue
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            if model is ref:
                inp = x
            else:  # the global batch as a DTensor sharded over dp: the loss is its global mean
                inp = DTensor.from_local(
                    x.chunk(2)[dp], mesh, (Shard(0), Replicate()), run_check=False
                )
            loss = model(inp).pow(2).mean()
            (loss.full_tensor() if isinstance(loss, DTensor) else loss).backward()
            opt.step()
            opt.zero_grad()
        results.append({n: full(p.detach()) for n, p in model.named_parameters()})
    placements = {n: tuple(p.placements) for n, p in ours.named_parameters()}
    return results, placements


def test_dp_mesh_dims_full_mesh_matches_fsdp2(run_ranks):
    """``mesh`` is the full (dp, tp) mesh and ``dp_mesh_dims`` names the FSDP dim: the same
    parameters as torch FSDP2 with ``dp_mesh_dims`` after three SGD steps. The model computes
    on DTensors of the global batch, so its gradients are already global means split over dp
    (``Partial``): averaging over dp, as FSDP2 does by default, halves them, and
    ``set_gradient_divide_factor(1.0)`` gives the single-device reference."""
    for (ours, summed, theirs, ref), placements in run_ranks(4, rank_dp_mesh_dims, timeout=TIMEOUT):
        for name in ours:
            if theirs is not None:  # torch FSDP2 has dp_mesh_dims (torch >= 2.13)
                torch.testing.assert_close(ours[name], theirs[name], msg=name)
            torch.testing.assert_close(summed[name], ref[name], msg=name)
            assert not torch.allclose(ours[name], ref[name])
        assert repr(placements["w1"][0]) == strided(2)
        assert placements["w2"] == (Shard(0), Shard(1))
        assert placements["scale"] == (Shard(0), Replicate())
