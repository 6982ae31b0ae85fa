"""The routes of the plugin's transport (``_transport.py``): the gloo stand-ins and shared
memory give torch.distributed's own results bit for bit, in training too, and each size
and layout of all-gather takes its route."""

import pytest
import torch
from torch import nn

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing.counting import CollectiveCounter
from hyperfsdp_core.testing.reference import Transformer, lm_loss, local_slice, token_batch


def root_transport(model):
    """The plugin's transport of ``model``'s root (None: torch.distributed's own)."""
    from hyperfsdp_shm.plugin import ROOT_TRANSPORT

    from hyperfsdp_core.plugin import unit_of

    return unit_of(model).root.stash.get(ROOT_TRANSPORT, None)


def _bits_of(t):
    return t.view(torch.uint8)


def gloo_stand_ins_match_native():
    import torch.distributed as dist
    from hyperfsdp_shm import _transport as coll

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
        coll.reduce_scatter_pair(pair, pack, dist.ReduceOp.SUM, None, rank).wait()
        out["rs pair"] = torch.equal(_bits_of(pair), _bits_of(native))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_all_reduce_stand_ins_are_bit_exact(run_ranks, world):
    for out in run_ranks(world, gloo_stand_ins_match_native):
        assert all(out.values()), out


def train_with_gloo_collectives(all_reduce: bool, subgroup: bool = False, shm: bool = False):
    from hyperfsdp_shm import _settings as coll
    from torch.distributed.tensor import Shard

    from hyperfsdp_core import MixedPrecisionPolicy

    saved, coll.GLOO_ALL_REDUCE = coll.GLOO_ALL_REDUCE, all_reduce
    saved_min, coll.GLOO_ALL_GATHER_MIN_BYTES = coll.GLOO_ALL_GATHER_MIN_BYTES, 0  # every size
    saved_shm, coll.SHM = coll.SHM, shm
    try:
        torch.manual_seed(0)
        model = Transformer(vocab=33, dim=12, n_layers=3, hidden=18)  # uneven shards
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = None
        if subgroup:  # FSDP over pairs of ranks: point-to-point in group ranks
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "shard"))["shard"]
        for i, block in enumerate(model.layers):
            kwargs = {"mp_policy": mp} if i == 1 else {}
            kwargs["mesh"] = mesh
            if i == 2:  # dim-1 shards (gathered into strided parts of the buffer) among dim-0
                kwargs["shard_placement_fn"] = lambda p: (
                    Shard(1) if p.ndim == 2 and p.shape[1] % 4 == 0 else None
                )
            fully_shard(block, **kwargs)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        with CollectiveCounter() as counter:
            for step in range(3):
                x, y = token_batch(step, 8, 5, 33)
                loss = lm_loss(model(local_slice(x)), local_slice(y))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        transport = root_transport(model)
        params = [p.detach().to_local().clone() for p in model.parameters()]
        kinds = {k: counter.count(k) for k in ("ag", "rs", "ar")}
        dim1 = [
            r.fqn
            for r in model.sharding_plan()
            if len(r.global_shape) == 2 and r.local_shape[1] != r.global_shape[1]
        ]
        assert dim1 == [
            "layers.2.attn.wqkv.weight",
            "layers.2.attn.wo.weight",
            "layers.2.mlp.w1.weight",
            "layers.2.mlp.w3.weight",
        ], dim1
        used_shm = transport is not None and any(t is not None for t in transport._shm.values())
        return losses, params, kinds, (transport is not None, used_shm)
    finally:
        coll.GLOO_ALL_REDUCE = saved
        coll.GLOO_ALL_GATHER_MIN_BYTES = saved_min
        coll.SHM = saved_shm


def gloo_all_reduce_training_is_exact(subgroup=False, shm=False):
    a = train_with_gloo_collectives(True, subgroup, shm)
    b = train_with_gloo_collectives(False, subgroup)
    same_params = all(torch.equal(_bits_of(x), _bits_of(y)) for x, y in zip(a[1], b[1]))
    return a[0] == b[0], same_params, a[2] == b[2], a[3], b[3]


@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
@pytest.mark.parametrize("world, subgroup", [(2, False), (4, False), (4, True)])
def test_training_with_gloo_all_reduce_equals_native_bit_for_bit(run_ranks, world, subgroup, shm):
    # blocks 0 and 1 gather row by row (all members on dim 0; block 1 in bf16): point to
    # point, or through shared memory; block 2 (dim-1 members) by an all-reduce, or into
    # a staging buffer through shared memory; subgroup: FSDP over pairs of ranks
    for losses, params, counts, on, off in run_ranks(
        world, gloo_all_reduce_training_is_exact, subgroup, shm
    ):
        assert (losses, params, counts, on, off) == (True, True, True, (True, shm), (False, False))


def all_gather_algorithm_by_size(shm: bool):
    import torch.distributed as dist
    from hyperfsdp_shm import _settings
    from hyperfsdp_shm import _transport as coll
    from torch.distributed.tensor import Shard

    from hyperfsdp_core.plugin import Transport

    calls: list[tuple[str, int]] = []

    def spy(name, fn):
        def call(*args, **kwargs):
            full = args
            rows = name in ("p2p", "rows shm")
            if name == "native":  # Transport.all_gather(self, output, ...)
                args = args[1:]
            views = args[0] if rows else [args[0]]  # each member's rows / the output
            calls.append((name, sum(v.numel() for v in views) * 4))
            return fn(*full, **kwargs)

        return call

    # torch.distributed's own (the core's default route), and the plugin's
    sites = [
        (Transport, "all_gather", "native"),
        (coll, "all_gather_by_all_reduce", "all_reduce"),
        (coll, "all_gather_p2p", "p2p"),
        (coll, "all_gather_shm", "shm"),
        (coll, "all_gather_rows_shm", "rows shm"),
    ]
    saved = [getattr(module, n) for module, n, _ in sites]
    saved_settings = (_settings.GLOO_ALL_GATHER_MIN_BYTES, _settings.SHM)
    for (module, n, label), fn in zip(sites, saved):
        setattr(module, n, spy(label, fn))
    _settings.GLOO_ALL_GATHER_MIN_BYTES = 4096  # between the small unit's size and the others'
    _settings.SHM = shm
    try:
        torch.manual_seed(0)
        # 2304 bytes unsharded; 16640 with every member on dim 0; 16640 with a dim-1 member
        small, big, big_dim1 = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        fully_shard(small)
        fully_shard(big)
        fully_shard(big_dim1, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
        model = nn.Sequential(small, big, big_dim1)
        fully_shard(model)
        model(torch.randn(2, 8) + dist.get_rank()).sum().backward()
        return sorted(set(calls))
    finally:
        for (module, n, _), fn in zip(sites, saved):
            setattr(module, n, fn)
        _settings.GLOO_ALL_GATHER_MIN_BYTES, _settings.SHM = saved_settings


def test_gloo_all_gather_algorithm_by_size_and_layout(run_ranks):
    # without shared memory: gloo's own under the threshold, point to point (dim 0) or an
    # all-reduce (a dim-1 member) from it
    for calls in run_ranks(2, all_gather_algorithm_by_size, False):
        assert calls == [("all_reduce", 16640), ("native", 2304), ("p2p", 16640)], calls
    # with it: every size through shared memory, row by row (dim 0) or into the staging
    # buffer (a dim-1 member)
    for calls in run_ranks(2, all_gather_algorithm_by_size, True):
        assert calls == [("rows shm", 2304), ("rows shm", 16640), ("shm", 16640)], calls


def test_environment_switches_are_read_when_a_root_transport_is_made(monkeypatch):
    """``HYPERFSDP_SHM``, ``HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES`` and
    ``HYPERFSDP_GLOO_NATIVE_COLLECTIVES`` set after import still apply to the next root
    (its transport is made at its lazy init)."""
    from hyperfsdp_shm.plugin import _make

    for name in ("SHM", "GLOO_ALL_GATHER_MIN_BYTES", "GLOO_NATIVE_COLLECTIVES"):
        monkeypatch.delenv(f"HYPERFSDP_{name}", raising=False)
    default = _make()
    monkeypatch.setenv("HYPERFSDP_SHM", "0")
    monkeypatch.setenv("HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES", "123")
    off = _make()
    monkeypatch.setenv("HYPERFSDP_GLOO_NATIVE_COLLECTIVES", "1")
    assert _make() is None  # no transport: torch.distributed's own collectives
    assert (default.use_shm, default.all_gather_min_bytes) == (True, 1 << 20)
    assert (off.use_shm, off.all_gather_min_bytes) == (False, 123)
