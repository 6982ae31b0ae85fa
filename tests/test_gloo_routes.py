"""The core's gloo routes (``hyperfsdp_core.comm.gloo``, the root's default on CPU) give
gloo's own results bit for bit, in training too, and each size and layout of all-gather
takes its route. The hyperfsdp-shm plugin is kept out of the way (``HYPERFSDP_SHM=0``:
it supplies no transport), as when it is not installed."""

import contextlib

import pytest
import torch

from hyperfsdp_core.testing.counting import (
    all_gather_routes_taken,
    train_every_gather_layout,
    trainings_match,
)


def root_transport(model):
    """The default transport of ``model``'s root."""
    from hyperfsdp_core.plugin import unit_of

    return unit_of(model).root.comm._hyperfsdp_comm.transport


@contextlib.contextmanager
def gloo_settings(native: bool, min_bytes: int | None):
    """The core's gloo switches for the roots made inside, without the shm plugin."""
    import os

    from hyperfsdp_core.comm import gloo

    saved = gloo.NATIVE, gloo.ALL_GATHER_MIN_BYTES, os.environ.get("HYPERFSDP_SHM")
    gloo.NATIVE, gloo.ALL_GATHER_MIN_BYTES = native, min_bytes
    os.environ["HYPERFSDP_SHM"] = "0"
    try:
        yield
    finally:
        gloo.NATIVE, gloo.ALL_GATHER_MIN_BYTES = saved[:2]
        if saved[2] is None:
            os.environ.pop("HYPERFSDP_SHM", None)
        else:
            os.environ["HYPERFSDP_SHM"] = saved[2]


def _bits_of(t):
    return t.view(torch.uint8)


def gloo_stand_ins_match_native():
    import torch.distributed as dist

    from hyperfsdp_core.comm import gloo as coll

    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for dtype, shard in ((torch.float32, 1001), (torch.bfloat16, 7), (torch.bfloat16, 8)):
        torch.manual_seed(rank)
        inp = torch.randn(shard).to(dtype)
        specials = torch.tensor([-0.0, float("inf"), float("-inf"), 1e-40]).to(dtype)
        inp[: len(specials)] = specials
        inp.view(torch.uint8)[-2:] = torch.tensor([0xC1, 0x7F], dtype=torch.uint8)  # a NaN payload
        native = torch.empty(world * shard, dtype=dtype)
        dist.all_gather_into_tensor(native, inp)
        mine = torch.zeros(world * shard, dtype=dtype)
        mine.view(world, shard)[rank] = inp
        coll.all_gather_by_all_reduce(mine, None, async_op=True).wait()
        out[f"ag {dtype} {shard}"] = torch.equal(_bits_of(mine), _bits_of(native))
        # point-to-point, into (world, n) rows of two members (split after 3 elements)
        p2p = torch.empty(world * shard, dtype=dtype)
        rows = [p2p[: world * 3].view(world, 3), p2p[world * 3 :].view(world, shard - 3)]
        rows[0][rank], rows[1][rank] = inp[:3], inp[3:]
        coll.all_gather_p2p(rows, rank, None).wait()
        expect = torch.cat(
            [native.view(world, shard)[:, :3].flatten(), native.view(world, shard)[:, 3:].flatten()]
        )
        out[f"ag p2p {dtype} {shard}"] = torch.equal(_bits_of(p2p), _bits_of(expect))
    torch.manual_seed(100 + rank)
    pack = torch.randn(world * 3001)
    native = torch.empty(3001)
    dist.reduce_scatter_tensor(native, pack.clone())
    mine = torch.empty(3001)
    work = coll.reduce_scatter_in_place(mine, pack, dist.ReduceOp.SUM, None, True, rank, world)
    out["rs before wait"] = work is not None
    work.wait()
    work.wait()  # idempotent
    out["rs"] = torch.equal(_bits_of(mine), _bits_of(native))
    if world == 2:  # the pair reduce-scatter
        torch.manual_seed(100 + rank)
        pack = torch.randn(world * 3001)
        pack[:2] = torch.tensor([-0.0, 0.0]) if rank else torch.tensor([-0.0, -0.0])
        dist.reduce_scatter_tensor(native, pack.clone())
        pair = torch.empty(3001)
        coll.reduce_scatter_pair(pair, pack, None, rank).wait()
        out["rs pair"] = torch.equal(_bits_of(pair), _bits_of(native))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_routes_are_bit_exact(run_ranks, world):
    for out in run_ranks(world, gloo_stand_ins_match_native):
        assert all(out.values()), out


def train_with_gloo_collectives(routes: bool, subgroup: bool = False):
    with gloo_settings(not routes, 0):  # every size
        out = train_every_gather_layout(subgroup)
    transport = root_transport(out["model"])
    return out["losses"], out["params"], out["kinds"], type(transport).__name__


def gloo_routes_training_is_exact(subgroup=False):
    return trainings_match(train_with_gloo_collectives, subgroup)


@pytest.mark.parametrize("world, subgroup", [(2, False), (4, False), (4, True)])
def test_training_with_gloo_routes_equals_native_bit_for_bit(run_ranks, world, subgroup):
    # blocks 0 and 1 gather row by row (all members on dim 0; block 1 in bf16): point to
    # point; block 2 (dim-1 members) by an all-reduce; subgroup: FSDP over pairs of ranks
    for losses, params, counts, on, off in run_ranks(
        world, gloo_routes_training_is_exact, subgroup
    ):
        assert (losses, params, counts, on, off) == (True, True, True, "GlooTransport", "Transport")


def all_gather_algorithm_by_size():
    from hyperfsdp_core.comm import gloo
    from hyperfsdp_core.plugin import Transport

    # torch.distributed's own and the core's gloo routes
    sites = [
        (Transport, "all_gather", "native"),
        (gloo, "all_gather_by_all_reduce", "all_reduce"),
        (gloo, "all_gather_p2p", "p2p"),
    ]
    with gloo_settings(False, 4096):  # between the small unit's size and the others'
        return all_gather_routes_taken(sites, rows=("p2p",))


def test_gloo_all_gather_algorithm_by_size_and_layout(run_ranks):
    # gloo's own under the threshold, point to point (dim 0) or an all-reduce (a dim-1
    # member) from it
    for calls in run_ranks(2, all_gather_algorithm_by_size):
        assert calls == [("all_reduce", 16640), ("native", 2304), ("p2p", 16640)], calls


def test_environment_switches_are_read_when_a_root_transport_is_made(monkeypatch):
    """``HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES`` and ``HYPERFSDP_GLOO_NATIVE_COLLECTIVES`` set
    after import still apply to the next root (its default transport is made at its lazy
    init); an accelerator's default is torch.distributed's own."""
    from hyperfsdp_core.comm.gloo import GlooTransport, default_transport
    from hyperfsdp_core.plugin import Transport

    cpu = torch.device("cpu")
    for name in ("GLOO_ALL_GATHER_MIN_BYTES", "GLOO_NATIVE_COLLECTIVES"):
        monkeypatch.delenv(f"HYPERFSDP_{name}", raising=False)
    default = default_transport(cpu)
    monkeypatch.setenv("HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES", "123")
    small = default_transport(cpu)
    assert type(default) is GlooTransport and default.all_gather_min_bytes == 1 << 20
    assert type(small) is GlooTransport and small.all_gather_min_bytes == 123
    assert GlooTransport.enabled()
    monkeypatch.setenv("HYPERFSDP_GLOO_NATIVE_COLLECTIVES", "1")
    assert type(default_transport(cpu)) is Transport  # gloo's own collectives
    assert not GlooTransport.enabled()
    monkeypatch.delenv("HYPERFSDP_GLOO_NATIVE_COLLECTIVES")
    assert type(default_transport(torch.device("meta"))) is Transport
