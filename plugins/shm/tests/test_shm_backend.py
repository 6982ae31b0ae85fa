"""The ``hyperfsdp_shm`` c10d backend (``register_shm_backend``): gloo groups whose
all-gathers and sum-reduce-scatters go through shared memory, bit for bit equal to gloo's,
however they are issued (``dist``, the functional collectives, DTensor), with everything
else on gloo."""

import pytest
import torch
from hyperfsdp_shm import _shm, register_shm_backend

pytestmark = pytest.mark.skipif(not _shm.supported(), reason="needs Linux, x86-64 and /dev/shm")


def _groups():
    """A gloo group and a ``hyperfsdp_shm`` group over every rank (every rank makes both)."""
    import torch.distributed as dist

    ranks = list(range(dist.get_world_size()))
    return dist.new_group(ranks, backend="gloo"), dist.new_group(
        ranks, backend=register_shm_backend()
    )


def _payload(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    if dtype.is_floating_point:
        t = (torch.randn(n) * 100).to(dtype)
        if n > 4:  # values whose sums depend on the order of additions
            t[:4] = torch.tensor([-0.0, 1e-30, 3e30, -3e30]).to(dtype)
        return t
    return torch.randint(-1000, 1000, (n,), dtype=dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).view(-1).view(torch.uint8)


def collectives_equal_gloo():
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    gloo, shm = _groups()
    rank, world = dist.get_rank(), dist.get_world_size()
    transport = shm.transport  # made now (collective), checking its order against gloo's
    before = transport.ops
    compared = 0
    chunk = _shm.CHUNK_BYTES
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        size = torch.tensor([], dtype=dtype).element_size()
        for n in (1, 4, 1001, 2 * chunk // size + 5):  # rows of world x n
            x = _payload(world * n, dtype, seed=rank * 31 + n)
            outs = {}
            for name, group in (("gloo", gloo), ("shm", shm)):
                rs = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(rs, x, group=group)
                ag = torch.empty(world * n, dtype=dtype)
                dist.all_gather_into_tensor(ag, x[:n], group=group)
                # a non-contiguous output, and the input already in place in the output
                ag_t = torch.empty(n, world, dtype=dtype).t()
                dist.all_gather_into_tensor(ag_t, x[n : 2 * n].view(1, n), group=group)
                in_place = torch.zeros(world * n, dtype=dtype)
                in_place.view(world, n)[rank] = x[:n]
                dist.all_gather_into_tensor(in_place, in_place.view(world, n)[rank], group=group)
                # a reduce-scatter into this rank's own part of its input
                rs_in_place = x.clone()
                rs_own = rs_in_place.view(world, n)[rank]
                dist.reduce_scatter_tensor(rs_own, rs_in_place, group=group)
                # the functional collectives (DTensor's), on dim 0 and dim 1, and coalesced
                rows = x.view(world, n)
                f_rs0 = funcol.wait_tensor(funcol.reduce_scatter_tensor(rows, "sum", 0, group))
                f_ag1 = funcol.wait_tensor(
                    funcol.all_gather_tensor(rows[:, :1].contiguous(), 1, group)
                )
                coalesced = funcol.all_gather_into_tensor_coalesced([x[:n], x[n : 2 * n]], group)
                reduced = funcol.reduce_scatter_tensor_coalesced([x, x * 2], "sum", [0, 0], group)
                outs[name] = [rs, ag, ag_t, in_place, rs_own.clone(), f_rs0, f_ag1]
                outs[name] += [funcol.wait_tensor(t) for t in (*coalesced, *reduced)]
            for a, b in zip(outs["gloo"], outs["shm"], strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(_bytes(a), _bytes(b)), (dtype, n)
                compared += 1
    return compared, transport is not None, transport.ops - before, transport.ring_order


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_equal_gloo_bit_for_bit_through_shared_memory(run_ranks, world):
    for compared, made, ops, ring_order in run_ranks(world, collectives_equal_gloo):
        assert made and ring_order
        assert compared == 4 * 4 * 11
        # every all-gather and reduce-scatter of the shm group, and nothing else, went
        # through the transport (4 dtypes x 4 sizes x 11 tensors in 10 collectives)
        assert ops == 4 * 4 * 11


def others_run_on_gloo():
    import torch.distributed as dist

    gloo, shm = _groups()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, group in (("gloo", gloo), ("shm", shm)):
        t = torch.arange(6.0) * (rank + 1)
        dist.all_reduce(t, group=group)
        b = torch.full((3,), float(rank))
        dist.broadcast(b, src=world - 1, group=group)
        m = torch.empty(2)
        dist.reduce_scatter_tensor(
            m, torch.arange(2.0 * world) * (rank - 1), op=dist.ReduceOp.MAX, group=group
        )
        objects = [None] * world
        dist.all_gather_object(objects, {"rank": rank}, group=group)
        dist.barrier(group=group)
        out[name] = (t, b, m, objects)
    ops = shm.transport.ops if shm.transport is not None else 0
    gloo_out, shm_out = out["gloo"], out["shm"]
    return (
        [torch.equal(a, b) for a, b in zip(gloo_out[:3], shm_out[:3])],
        gloo_out[3] == shm_out[3],
        ops,
    )


def test_other_collectives_run_on_gloo(run_ranks):
    for equal, objects_equal, ops in run_ranks(2, others_run_on_gloo):
        assert equal == [True, True, True] and objects_equal
        assert ops == 0  # a MAX reduce-scatter is gloo's; no transport was used


def without_shared_memory():
    import torch.distributed as dist

    from hyperfsdp_core.testing import shared_memory

    with shared_memory(False):
        gloo, shm = _groups()
        x = torch.arange(8.0) + dist.get_rank()
        outs = []
        for group in (gloo, shm):
            out = torch.empty(4)
            dist.reduce_scatter_tensor(out, x, group=group)
            outs.append(out)
        return shm.transport is None, torch.equal(*outs), repr(shm)


def test_without_shared_memory_the_group_is_gloo(run_ranks):
    for off, equal, text in run_ranks(2, without_shared_memory):
        assert off and equal
        assert text.startswith("ShmProcessGroup(rank=")


def fsdp_over_shm_mesh():
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from hyperfsdp_core import fully_shard
    from hyperfsdp_core.testing.reference import MLPStack, mlp_batch, mse_loss, train_parity

    # first a unit on a mesh of the same layout on gloo: the engine must not take the
    # shm mesh for it (meshes compare equal by layout and names, not by their groups)
    fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    mesh = init_device_mesh(
        "cpu", (dist.get_world_size(),), backend_override={0: register_shm_backend()}
    )
    group = mesh.get_group()
    before = group.transport.ops  # made now (collective; over four ranks it runs some)
    state = {}

    def shard(model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        state["root"] = fully_shard(model, mesh=mesh)

    out = train_parity(
        lambda: MLPStack([16, 40, 33, 16]),
        shard,
        lambda step: mlp_batch(step, 8, 16),
        mse_loss,
        steps=3,
    )
    from hyperfsdp_shm.plugin import ROOT_TRANSPORT

    from hyperfsdp_core.plugin import unit_of

    transport = unit_of(state["root"]).root.stash[ROOT_TRANSPORT]
    return out["losses"], transport.shm(group) is group.transport, group.transport.ops - before


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_on_a_shm_backend_mesh_matches_the_reference(run_ranks, world):
    # train_parity asserts losses and parameters against the unsharded reference (fp32
    # tolerance); the engine uses the group's own transport rather than a second one,
    # though a unit on a gloo mesh of the same layout came first,
    # though earlier tests on these ranks made meshes of the same layout on gloo
    results = run_ranks(world, fsdp_over_shm_mesh)
    for losses, shared, ops in results:
        assert losses == results[0][0]
        assert shared and ops > 0


def test_register_shm_backend_is_idempotent():
    import torch.distributed as dist

    assert register_shm_backend() == register_shm_backend() == "hyperfsdp_shm"
    assert "hyperfsdp_shm" in dist.Backend.backend_list


def waits_as_long_as_the_group():
    from datetime import timedelta

    import torch.distributed as dist

    group = dist.new_group([0, 1], backend=register_shm_backend(), timeout=timedelta(seconds=7))
    return group.transport.timeout


def test_transport_waits_as_long_as_its_group(run_ranks):
    # a peer that never joins fails the collective after the group's timeout (as gloo would)
    assert run_ranks(2, waits_as_long_as_the_group) == [7.0, 7.0]


def caches_tell_equal_meshes_apart():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyperfsdp_core.plugin import ProcessGroupCache

    shape = (dist.get_world_size(),)
    on_gloo = init_device_mesh("cpu", shape, mesh_dim_names=("dp",))
    on_shm = init_device_mesh(
        "cpu", shape, mesh_dim_names=("dp",), backend_override={"dp": register_shm_backend()}
    )
    cache: ProcessGroupCache = ProcessGroupCache()
    made = [
        cache.setdefault(on_gloo, lambda: "gloo"),
        cache.setdefault(on_shm, lambda: "shm"),
        cache.setdefault((on_gloo, "x"), lambda: "gloo, x"),
        cache.setdefault((on_shm, "x"), lambda: "shm, x"),
        cache.setdefault(on_shm, lambda: "again"),
    ]
    return on_gloo == on_shm, made


def test_caches_keep_equal_meshes_with_other_groups_apart(run_ranks):
    # DeviceMeshes of one layout and names compare equal whatever their groups; the caches
    # plugins use (ProcessGroupCache) key on the groups too, also inside tuple keys
    for equal, made in run_ranks(2, caches_tell_equal_meshes_apart):
        assert equal
        assert made == ["gloo", "shm", "gloo, x", "shm, x", "shm"]
