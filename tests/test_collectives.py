"""Collective counts per step, counted at torch.distributed itself."""

import pytest
import torch
from torch import nn

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing.counting import CollectiveCounter
from hyperfsdp_core.testing.reference import Transformer, lm_loss, local_slice, token_batch

KINDS = (("all_gather", "ag"), ("reduce_scatter", "rs"), ("all_reduce", "ar"))


def counts_per_step(reshard_after_forward, n_layers=3):
    torch.manual_seed(0)
    model = Transformer(vocab=31, dim=8, n_layers=n_layers, hidden=12)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for step in range(3):
        x, y = token_batch(step, 4, 5, 31)
        with CollectiveCounter() as counter:
            lm_loss(model(local_slice(x)), local_slice(y)).backward()
        opt.step()
        opt.zero_grad()
        results.append({kind: counter.count(short) for kind, short in KINDS})
    stats = model._hyperfsdp_state.ctx.comm.stats.snapshot()
    return results, stats


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_collectives_per_step(run_ranks, reshard_after_forward):
    n_layers = 3
    per_rank = run_ranks(2, counts_per_step, reshard_after_forward, n_layers)
    # non-root units gather in forward and (after resharding) again in backward; the
    # root keeps its parameters after forward and gathers once; every unit
    # reduce-scatters once; nothing is all-reduced in pure FSDP
    gathers = n_layers * (2 if reshard_after_forward else 1) + 1
    expected = {"all_gather": gathers, "reduce_scatter": n_layers + 1, "all_reduce": 0}
    for steps, stats in per_rank:
        assert steps == [expected] * 3
        assert stats["all_gathers"] == 3 * gathers
        assert stats["reduce_scatters"] == 3 * (n_layers + 1)


def saved_by_no_reshard():
    a = counts_per_step(True, 2)[0][0]["all_gather"]
    b = counts_per_step(False, 2)[0][0]["all_gather"]
    return a - b


def test_reshard_after_forward_false_saves_backward_gathers(run_ranks):
    assert run_ranks(2, saved_by_no_reshard) == [2, 2]


def world_one_issues_nothing():
    per_step, _ = counts_per_step(True, 2)
    return per_step[0]


def test_world_one_has_no_collectives(run_ranks):
    # shard size 1: parameters alias their storage, gradients are local
    assert run_ranks(1, world_one_issues_nothing) == [
        {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    ]


# -- gloo: all-gathers and reduce-scatters as in-place all-reduces --------------------------------


def _bits_of(t):
    return t.view(torch.uint8)


def gloo_stand_ins_match_native():
    import torch.distributed as dist

    from hyperfsdp_core import _collectives as coll

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
        coll._all_gather_by_all_reduce(mine, group=None, async_op=True).wait()
        out[f"ag {dtype} {shard}"] = torch.equal(_bits_of(mine), _bits_of(native))
        # point-to-point, into (world, n) rows of two members (split after 3 elements)
        p2p = torch.empty(world * shard, dtype=dtype)
        rows = [p2p[: world * 3].view(world, 3), p2p[world * 3 :].view(world, shard - 3)]
        rows[0][rank], rows[1][rank] = inp[:3], inp[3:]
        coll._all_gather_p2p(rows, rank, group=None).wait()
        expect = torch.cat(
            [native.view(world, shard)[:, :3].flatten(), native.view(world, shard)[:, 3:].flatten()]
        )
        out[f"ag p2p {dtype} {shard}"] = torch.equal(_bits_of(p2p), _bits_of(expect))
    torch.manual_seed(100 + rank)
    pack = torch.randn(world * 3001)
    native = torch.empty(3001)
    dist.reduce_scatter_tensor(native, pack.clone())
    mine = torch.empty(3001)
    work = coll._reduce_scatter_in_place(
        mine, pack, op=dist.ReduceOp.SUM, group=None, async_op=True, rank=rank, world=world
    )
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
        coll._reduce_scatter_pair(pair, pack, op=dist.ReduceOp.SUM, group=None, rank=rank).wait()
        out["rs pair"] = torch.equal(_bits_of(pair), _bits_of(native))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_all_reduce_stand_ins_are_bit_exact(run_ranks, world):
    for out in run_ranks(world, gloo_stand_ins_match_native):
        assert all(out.values()), out


def train_with_gloo_collectives(all_reduce: bool, subgroup: bool = False, shm: bool = False):
    from torch.distributed.tensor import Shard

    from hyperfsdp_core import MixedPrecisionPolicy
    from hyperfsdp_core import _collectives as coll

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
        comm = model._hyperfsdp_state.ctx.comm
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
        used_shm = any(t is not None for t in comm._shm.values())
        return losses, params, kinds, (comm.uses_all_reduce(None), used_shm)
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
    from torch.distributed.tensor import Shard

    from hyperfsdp_core import _collectives as coll

    calls: list[tuple[str, int]] = []

    def spy(name, fn):
        def call(*args, **kwargs):
            rows = name in ("p2p", "rows shm")
            views = args[0] if rows else [args[0]]  # each member's rows / the output
            calls.append((name, sum(v.numel() for v in views) * 4))
            return fn(*args, **kwargs)

        return call

    names = (
        "_all_gather",
        "_all_gather_by_all_reduce",
        "_all_gather_p2p",
        "_all_gather_shm",
        "_all_gather_rows_shm",
    )
    labels = ("native", "all_reduce", "p2p", "shm", "rows shm")
    saved = [getattr(coll, n) for n in names] + [coll.GLOO_ALL_GATHER_MIN_BYTES, coll.SHM]
    for n, label, fn in zip(names, labels, saved):
        setattr(coll, n, spy(label, fn))
    coll.GLOO_ALL_GATHER_MIN_BYTES = 4096  # between the small unit's size and the others'
    coll.SHM = shm
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
        for n, fn in zip(names, saved):
            setattr(coll, n, fn)
        coll.GLOO_ALL_GATHER_MIN_BYTES, coll.SHM = saved[-2:]


def test_gloo_all_gather_algorithm_by_size_and_layout(run_ranks):
    # without shared memory: gloo's own under the threshold, point to point (dim 0) or an
    # all-reduce (a dim-1 member) from it
    for calls in run_ranks(2, all_gather_algorithm_by_size, False):
        assert calls == [("all_reduce", 16640), ("native", 2304), ("p2p", 16640)], calls
    # with it: every size through shared memory, row by row (dim 0) or into the staging
    # buffer (a dim-1 member)
    for calls in run_ranks(2, all_gather_algorithm_by_size, True):
        assert calls == [("rows shm", 2304), ("rows shm", 16640), ("shm", 16640)], calls


# -- CPU: resharded unsharded buffers park their memory for the next unshard ---------------------


def test_storage_pool_parks_and_hands_back_memory():
    from hyperfsdp_core._collectives import StoragePool

    pool = StoragePool(max_idle=1)
    a, b = torch.arange(6.0), torch.zeros(6)
    view = a[2:4]  # a saved view stays valid, as with resize_
    ptr = a.data_ptr()
    pool.park(a.untyped_storage())
    assert a.untyped_storage().nbytes() == 0 and pool.nbytes == 24
    b.untyped_storage().resize_(0)
    assert not pool.unpark(b.untyped_storage(), 12)  # another size: not handed out
    assert pool.unpark(b.untyped_storage(), 24)
    assert b.data_ptr() == ptr and b.tolist() == [0, 1, 2, 3, 4, 5] and pool.nbytes == 0
    a.untyped_storage().resize_(24)
    a.copy_(torch.full((6,), 7.0))
    assert view.tolist() == [7.0, 7.0]
    pool.park(a.untyped_storage())
    pool.park(b.untyped_storage())  # over max_idle: freed instead
    assert pool.nbytes == 24 and b.untyped_storage().nbytes() == 0
    pool.park(torch.zeros(3).untyped_storage())  # a new size class drops the old one
    assert pool.nbytes == 12
    pool.clear()
    assert pool.nbytes == 0


def unsharded_memory_reuse(shm):
    from hyperfsdp_core import _collectives as coll
    from hyperfsdp_core.testing import shared_memory

    # the in-place all-gather (that of large units) for these tiny ones
    saved, coll.GLOO_ALL_GATHER_MIN_BYTES = coll.GLOO_ALL_GATHER_MIN_BYTES, 0
    saved_rs = coll._reduce_scatter_shm
    rs_inputs = []

    def spy(output, input, **kw):
        rs_inputs.append(input.data_ptr())
        return saved_rs(output, input, **kw)

    coll._reduce_scatter_shm = spy
    try:
        with shared_memory(shm):
            return (*_unsharded_memory_reuse(), rs_inputs[-5:-1])  # the blocks, not the root
    finally:
        coll.GLOO_ALL_GATHER_MIN_BYTES = saved
        coll._reduce_scatter_shm = saved_rs


def _unsharded_memory_reuse():
    torch.manual_seed(0)
    model = Transformer(vocab=31, dim=8, n_layers=4, hidden=12)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    ptrs, bwd_ptrs = [], []

    def record(module, args, output):
        ptrs.append(module._hyperfsdp_state.group.buckets[0].unsharded_flat.data_ptr())

    def record_backward(module, grad_input, grad_output):
        bwd_ptrs.append(module._hyperfsdp_state.group.buckets[0].unsharded_flat.data_ptr())

    for block in model.layers:
        block.register_forward_hook(record, prepend=True)  # before the reshard
        block.register_full_backward_hook(record_backward)  # before its post-backward
    for step in range(2):  # the second forward prefetches (the first learns the order)
        ptrs.clear()
        bwd_ptrs.clear()
        x, y = token_batch(step, 4, 5, 31)
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
    comm = model._hyperfsdp_state.ctx.comm
    return ptrs, bwd_ptrs, comm.pooled_bytes


def test_resharded_memory_goes_to_the_next_unshard(run_ranks):
    for ptrs, _, pooled, _ in run_ranks(2, unsharded_memory_reuse, False):
        # block 1 is prefetched while block 0 is unsharded; block 2 once block 0 has
        # resharded: it gets block 0's memory
        assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[0] != ptrs[1]
        assert pooled == 0  # nothing held past the backward


def test_one_buffer_is_handed_along_when_gathers_run_in_line(run_ranks):
    for ptrs, bwd_ptrs, pooled, rs_inputs in run_ranks(2, unsharded_memory_reuse, True):
        # no prefetch: each block gathers into the memory the block before it resharded;
        # in backward a block's reshard parks it, its reduce-scatter input takes it, and
        # the next block's gather takes it back
        assert len(set(ptrs)) == 1 and len(ptrs) == 4
        assert len(bwd_ptrs) == 4 and len(set(bwd_ptrs)) == 1
        assert set(rs_inputs) == set(bwd_ptrs)
        assert pooled == 0


def gradients_freed_before_reduce(shm):
    import weakref

    from hyperfsdp_core import _collectives as coll
    from hyperfsdp_core._param import HSDPParam
    from hyperfsdp_core.testing import shared_memory

    taken, alive_at_issue = [], []
    saved_take, saved_rs = HSDPParam.take_unsharded_grad, coll.Comm.reduce_scatter

    def take(self):
        grad = saved_take(self)
        if grad is not None:
            taken.append(weakref.ref(grad))
        return grad

    def reduce_scatter(self, output, *args, **kw):
        alive_at_issue.append(sum(ref() is not None for ref in taken))
        taken.clear()
        return saved_rs(self, output, *args, **kw)

    HSDPParam.take_unsharded_grad, coll.Comm.reduce_scatter = take, reduce_scatter
    try:
        with shared_memory(shm):
            torch.manual_seed(0)
            model = Transformer(vocab=31, dim=8, n_layers=2, hidden=12)
            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
            for step in range(2):
                x, y = token_batch(step, 4, 5, 31)
                lm_loss(model(local_slice(x)), local_slice(y)).backward()
    finally:
        HSDPParam.take_unsharded_grad, coll.Comm.reduce_scatter = saved_take, saved_rs
    return alive_at_issue


@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
def test_gradients_are_freed_once_packed(run_ranks, shm):
    """A unit's unsharded gradients are freed once packed into the reduce-scatter input,
    before its output is allocated: the two are never held together, and the output can
    take the gradients' memory (param-heavy: peak RSS about 80 MiB lower)."""
    for alive in run_ranks(2, gradients_freed_before_reduce, shm):
        assert len(alive) == 6  # 3 units x 2 steps, each with several gradients packed
        assert alive == [0] * 6


def test_environment_switches_are_read_when_a_root_comm_is_made(monkeypatch):
    """``HYPERFSDP_SHM``, ``HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES`` and
    ``HYPERFSDP_GLOO_NATIVE_COLLECTIVES`` set after import still apply to the next root."""
    from hyperfsdp_core import _collectives as coll

    for name in ("SHM", "GLOO_ALL_GATHER_MIN_BYTES", "GLOO_NATIVE_COLLECTIVES"):
        monkeypatch.delenv(f"HYPERFSDP_{name}", raising=False)
    cpu = torch.device("cpu")
    default = coll.Comm(cpu)
    monkeypatch.setenv("HYPERFSDP_SHM", "0")
    monkeypatch.setenv("HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES", "123")
    off = coll.Comm(cpu)
    monkeypatch.setenv("HYPERFSDP_GLOO_NATIVE_COLLECTIVES", "1")
    native = coll.Comm(cpu)
    assert (default.use_shm, default.gloo_all_reduce) == (True, True)
    assert (off.use_shm, off.all_gather_min_bytes, off.gloo_all_reduce) == (False, 123, True)
    assert (native.use_shm, native.gloo_all_reduce) == (False, False)
