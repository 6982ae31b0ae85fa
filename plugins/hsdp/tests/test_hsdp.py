"""HSDP plugin: parity against a single-process reference on the global batch (world 4)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing.counting import CollectiveCounter
from hyperfsdp_core.testing.reference import (
    Transformer,
    assert_close_params,
    lm_loss,
    local_slice,
    token_batch,
)

VOCAB = 37


Count = CollectiveCounter


def build():
    torch.manual_seed(0)
    return Transformer(vocab=VOCAB, dim=16, n_layers=2, n_heads=2, hidden=27)


def mesh_for(shape):
    if len(shape) == 1:
        return init_device_mesh("cpu", shape)
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def shard(model, mesh, replicate=None, **kwargs):
    replicate = replicate or (lambda module: set())
    for block in model.layers:
        fully_shard(block, mesh=mesh, replicate_params=replicate(block), **kwargs)
    fully_shard(model, mesh=mesh, replicate_params=replicate(model) - _in_blocks(model), **kwargs)
    return model


def _in_blocks(model):
    return {p for block in model.layers for p in block.parameters()}


def norms(module):
    return {p for name, p in module.named_parameters() if "norm" in name}


def train(model, ref, steps=3, divide_factor=None, micro=1, counts=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    world = dist.get_world_size()
    if divide_factor is not None:
        for m in [model, *model.layers]:
            m.set_gradient_divide_factor(divide_factor)
    for step in range(steps):
        for i in range(micro):
            last = i == micro - 1
            if micro > 1:
                model.set_requires_all_reduce(last)
            x, y = token_batch(10 * step + i, 2 * world, 5, VOCAB)
            with Count() as c:
                lm_loss(model(local_slice(x)), local_slice(y)).backward()
            if counts is not None:
                counts.append(c.calls)
            ref_loss = lm_loss(ref(x), y)
            if divide_factor is not None:  # gradients summed over ranks, divided by the factor
                ref_loss = ref_loss * world / divide_factor
            ref_loss.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert_close_params(model, ref)


def parity(shape, replicate_norms=False):
    model = build()
    ref = copy.deepcopy(model)
    mesh = mesh_for(shape)
    shard(model, mesh, norms if replicate_norms else None)
    counts = []
    train(model, ref, counts=counts)
    w = model.layers[0].attn.wqkv.weight
    plan = {
        row.fqn: (row.mesh_kind, row.shard_size, row.replicate_size, row.needs_all_gather)
        for row in model.sharding_plan()
    }
    return tuple(w.placements), counts[-1], plan


@pytest.mark.parametrize("shape", [(2, 2), (4, 1), (1, 4)])
def test_hsdp_parity(run_ranks, shape):
    r, s = shape
    for placements, calls, plan in run_ranks(4, parity, shape):
        assert placements == (Replicate(), Shard(0))
        assert plan["layers.0.attn.wqkv.weight"] == ("HSDP", s, r, s > 1)
        units = 3  # two blocks and the root
        gathers = [n for k, n, _ in calls if k == "ag"]
        assert gathers == ([s] * (2 * 2 + 1) if s > 1 else [])  # (4, 1): never all-gathers
        assert [n for k, n, _ in calls if k == "rs"] == ([s] * units if s > 1 else [])
        # one all-reduce per unit over the replicate group (one dtype, one group each)
        assert [n for k, n, _ in calls if k == "ar"] == ([r] * units if r > 1 else [])


def test_replicate_params_on_1d_and_2d_meshes(run_ranks):
    for shape in [(4,), (2, 2)]:
        for _, calls, plan in run_ranks(4, parity, shape, True):
            assert plan["layers.0.attn_norm.weight"] == ("DDP", 1, 4, False)  # all R*S ranks
            assert plan["norm.weight"] == ("DDP", 1, 4, False)
            kinds = {kind for kind, *_ in plan.values()}
            assert kinds == {"DDP", "FSDP" if len(shape) == 1 else "HSDP"}
            ar_sizes = sorted(n for k, n, _ in calls if k == "ar")
            if len(shape) == 1:  # only the replicated norms all-reduce, once per unit
                assert ar_sizes == [4, 4, 4]
            else:  # per unit: one over the replicate group, one over all ranks
                assert ar_sizes == [2, 2, 2, 4, 4, 4]


def alias_path():
    model = build()
    mesh = mesh_for((4, 1))
    shard(model, mesh)
    x = local_slice(token_batch(0, 8, 5, VOCAB)[0])
    model(x).sum().backward()  # lazy init
    block = model.layers[0]
    name, sharded = next(iter(block.named_parameters()))
    with Count() as c:
        model(x).sum().backward()
        block.unshard()
    unsharded = dict(block.named_parameters())[name]
    row = next(r for r in block.sharding_plan() if r.fqn == name)
    return {
        "aliases": unsharded.data_ptr() == sharded.to_local().data_ptr(),
        "owner": row.storage_owner,
        "needs_all_gather": row.needs_all_gather,
        "gathers": c.count("ag"),
    }


def test_shard_size_one_aliases_the_local_shard(run_ranks):
    for info in run_ranks(4, alias_path):
        assert info == {
            "aliases": True,
            "owner": "sharded_storage",
            "needs_all_gather": False,
            "gathers": 0,
        }


def mixed_unit_groups():
    """A unit holding HSDP-sharded and replicated parameters forms two all-reduce groups."""
    model = build()
    ref = copy.deepcopy(model)
    mesh = mesh_for((2, 2))
    shard(model, mesh, norms)
    counts = []
    train(model, ref, steps=2, counts=counts)
    kinds = sorted({row.mesh_kind for row in model.layers[0].sharding_plan()})
    return kinds, sorted(n for k, n, _ in counts[-1] if k == "ar")


def test_unit_mixing_sharded_and_replicated_params(run_ranks):
    for kinds, ar_sizes in run_ranks(4, mixed_unit_groups):
        assert kinds == ["DDP", "HSDP"]
        assert ar_sizes == [2, 2, 2, 4, 4, 4]


def accumulate_reduce_scatter_only():
    model = build()
    ref = copy.deepcopy(model)
    shard(model, mesh_for((2, 2)))
    counts = []
    train(model, ref, steps=2, micro=3, counts=counts)
    return [sum(1 for k, *_ in calls if k == "ar") for calls in counts]


def test_accumulation_with_requires_all_reduce_false(run_ranks):
    for ars in run_ranks(4, accumulate_reduce_scatter_only):
        assert ars == [0, 0, 3] * 2  # reduce-scatter every micro-batch, all-reduce the last


@pytest.mark.parametrize("divide_factor", [None, 1.0, 2.0])
def test_sum_and_average_semantics(run_ranks, divide_factor):
    assert run_ranks(4, semantics, divide_factor) == [True] * 4


def semantics(divide_factor):
    """AVG (default: divide by R*S) or SUM (factor 1): scaling is applied exactly once."""
    model = build()
    ref = copy.deepcopy(model)
    shard(model, mesh_for((2, 2)), norms)
    train(model, ref, steps=2, divide_factor=divide_factor)
    return True


def plan_text():
    model = build()
    shard(model, mesh_for((2, 2)), norms)
    return str(model.sharding_plan())


def test_sharding_plan_shows_topology(run_ranks):
    text = run_ranks(4, plan_text)[0]
    assert "HSDP s=2 r=2" in text and "DDP s=1 r=4" in text


def later_phase_sees_all_reduced_grads():
    """A phase ordered after dp.all_reduce (where tensor parallelism's goes) finds every
    gradient applied; the core drain alone would leave the HSDP ones pending."""
    from hyperfsdp_core.plugin import Phase, get_plugin_manager, hookimpl

    seen = []

    class Later:
        @hookimpl
        def hyperfsdp_finalize_phases(self):
            return [
                Phase("test.after_dp", lambda ctx: seen.append(snapshot()), after="dp.all_reduce")
            ]

    def snapshot():
        return sorted(n for n, p in model.named_parameters() if p.grad is None)

    pm = get_plugin_manager()
    pm.register(Later(), name="test_later")
    try:
        model = build()
        shard(model, mesh_for((2, 2)), norms)
        order = [phase.name for phase in pm.finalization_phases()]
        model(local_slice(token_batch(0, 8, 5, VOCAB)[0])).sum().backward()
    finally:
        pm.unregister(name="test_later")
    return order, seen


def test_phase_after_dp_all_reduce_sees_every_gradient(run_ranks):
    for order, seen in run_ranks(4, later_phase_sees_all_reduced_grads):
        ours = [name for name in order if name.split(".")[0] in ("core", "dp", "test")]
        assert ours == ["core.reduce_scatter_drain", "dp.all_reduce", "test.after_dp"]
        assert seen == [[]]  # one backward, no parameter without its gradient


def hsdp_mixed_precision():
    """bf16 compute, fp32 reduce on a (2, 2) mesh: the all-reduce runs in the reduce dtype."""
    from hyperfsdp_core import MixedPrecisionPolicy
    from hyperfsdp_core.plugin import get_plugin_manager, hookimpl

    ar_dtypes = []

    class Observer:  # records the dtype of every all-reduce the root issues
        @hookimpl
        def hyperfsdp_collective_observer(self, root):
            return lambda e: ar_dtypes.append(str(e.dtype)) if e.kind == "all_reduce" else None

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = build()
    mesh = mesh_for((2, 2))
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    x, y = token_batch(0, 8, 5, VOCAB)
    pm = get_plugin_manager()
    observer = Observer()
    pm.register(observer, name="test_observer")
    try:
        lm_loss(model(local_slice(x)).float(), local_slice(y)).backward()  # lazy init
    finally:
        pm.unregister(observer)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    masters = {str(p.dtype) for p in model.parameters()}
    return ar_dtypes, masters, grads


def test_hsdp_with_mixed_precision(run_ranks):
    results = run_ranks(4, hsdp_mixed_precision)
    for ar_dtypes, masters, grads in results:
        assert ar_dtypes == ["torch.float32"] * 3 and masters == {"torch.float32"}
        for name, g in grads.items():  # both replicas hold the same all-reduced gradient
            torch.testing.assert_close(g, results[0][2][name], msg=name)


def flush_partial_sums(last_backward_syncs):
    """Micro-batches with all-reduce off leave reduce-scatter sums held; they are
    all-reduced once all-reduce is on again: by the next backward, or by reduce_grads()
    when no backward follows (a pipeline schedule's explicit reduce)."""
    model = build()
    ref = copy.deepcopy(model)
    shard(model, mesh_for((2, 2)), norms)
    world = dist.get_world_size()
    model.set_requires_all_reduce(False)
    counts = []
    for i in range(3):
        x, y = token_batch(i, 2 * world, 5, VOCAB)
        last = i == 2
        if last and last_backward_syncs:
            model.set_requires_all_reduce(True)
        with Count() as c:
            lm_loss(model(local_slice(x)), local_slice(y)).backward()
        counts.append(sum(1 for k, *_ in c.calls if k == "ar"))
        lm_loss(ref(x), y).backward()
    pending = {n for n, p in model.named_parameters() if p.grad is None}
    with Count() as c:
        model.reduce_grads()
    counts.append(sum(1 for k, *_ in c.calls if k == "ar"))
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=n, atol=1e-5, rtol=1e-4)
    return counts, sorted(pending)


@pytest.mark.parametrize("last_backward_syncs", [True, False])
def test_partial_sums_are_flushed_when_all_reduce_is_back_on(run_ranks, last_backward_syncs):
    for counts, pending in run_ranks(4, flush_partial_sums, last_backward_syncs, timeout=120):
        if last_backward_syncs:
            # the last backward all-reduces, per unit, the HSDP bucket over the replicate
            # group and the replicated norms over all 4 ranks; nothing is left after
            assert counts == [0, 0, 6, 0]
            assert pending == []
        else:
            # until reduce_grads() every gradient is held; it all-reduces the held sums of
            # all three units at once: one all-reduce per process group
            assert counts == [0, 0, 0, 2]
            assert len(pending) == len(set(pending)) > 10


def parity_on_a_simulated_accelerator(shape):
    """``parity`` with the accelerator code path: streams, events, the plugin's
    all-reduces through ``root.comm`` (see ``hyperfsdp_core.testing.streams``)."""
    from hyperfsdp_core.testing.streams import simulated_accelerator

    with simulated_accelerator() as sim:
        _, calls, _ = parity(shape)
        streams = sorted({(name, stream) for _, name, stream, _ in sim.collectives})
    return sim.violations, calls, streams


@pytest.mark.parametrize("shape", [(2, 2), (4,)])
def test_hsdp_streams_are_ordered_on_a_simulated_accelerator(run_ranks, shape):
    for violations, calls, streams in run_ranks(4, parity_on_a_simulated_accelerator, shape):
        assert violations == []
        assert ("c10d._allgather_base_.default", "all_gather") in streams
        if len(shape) == 2:  # the replicate all-reduce runs on the reduce stream
            assert ("c10d.allreduce_.default", "reduce") in streams
            assert [n for k, n, _ in calls if k == "ar"] == [2] * 3
