"""Collective counts per step, counted where the core issues them; CPU buffer reuse.

The routes of the ``hyperfsdp-shm`` transport (shared memory, gloo stand-ins) are tested
with it, in plugins/shm/tests."""

import os

import pytest
import torch

from hyperfsdp_core import fully_shard
from hyperfsdp_core._torch_private import STORAGE_MEMORY_SWAPPABLE
from hyperfsdp_core.comm import Comm
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


# -- CPU: resharded unsharded buffers park their memory for the next unshard ---------------------

needs_swap = pytest.mark.skipif(
    not STORAGE_MEMORY_SWAPPABLE,
    reason="parking needs UntypedStorage._swap_data_ptr_ (torch 2.13); before, the pool is off",
)


def test_the_pool_is_on_exactly_where_torch_can_swap_storage_memory():
    """Before torch 2.13 a CPU root has no pool of parked memory (reshard frees, as on an
    accelerator); from 2.13 it has one."""
    comm = Comm(torch.device("cpu"))
    assert (comm.storage_pool is not None) == STORAGE_MEMORY_SWAPPABLE
    assert comm.pooled_bytes == 0


@needs_swap
def test_storage_pool_parks_and_hands_back_memory():
    from hyperfsdp_core.comm import StoragePool

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


MIN_BYTES = "HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES"


def unsharded_memory_reuse(shm):
    from hyperfsdp_core.comm import Comm
    from hyperfsdp_core.testing import shared_memory

    saved_rs = Comm.reduce_scatter
    rs_inputs = []

    def spy(self, output, input, *args, **kw):
        rs_inputs.append(input.data_ptr())
        return saved_rs(self, output, input, *args, **kw)

    Comm.reduce_scatter = spy
    # hyperfsdp-shm's in-place all-gather (that of large units) for these tiny ones
    saved_min = os.environ.get(MIN_BYTES)
    os.environ[MIN_BYTES] = "0"
    try:
        with shared_memory(shm):
            return (*_unsharded_memory_reuse(), rs_inputs[-5:-1])  # the blocks, not the root
    finally:
        Comm.reduce_scatter = saved_rs
        if saved_min is None:
            del os.environ[MIN_BYTES]
        else:
            os.environ[MIN_BYTES] = saved_min


def _unsharded_memory_reuse():
    torch.manual_seed(0)
    model = Transformer(vocab=31, dim=8, n_layers=4, hidden=12)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    ptrs, bwd_ptrs = [], []

    def record(module, args, output):
        ptrs.append(module._hyperfsdp_state.group.buckets[0].payload.unsharded_flat.data_ptr())

    def record_backward(module, grad_input, grad_output):
        bwd_ptrs.append(module._hyperfsdp_state.group.buckets[0].payload.unsharded_flat.data_ptr())

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


@needs_swap
def test_resharded_memory_goes_to_the_next_unshard(run_ranks):
    for ptrs, _, pooled, _ in run_ranks(2, unsharded_memory_reuse, False):
        # block 1 is prefetched while block 0 is unsharded; block 2 once block 0 has
        # resharded: it gets block 0's memory
        assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[0] != ptrs[1]
        assert pooled == 0  # nothing held past the backward


@needs_swap
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

    from hyperfsdp_core.comm import Comm
    from hyperfsdp_core.engine.param import ShardedParam
    from hyperfsdp_core.testing import shared_memory

    taken, alive_at_issue = [], []
    saved_take, saved_rs = ShardedParam.take_unsharded_grad, Comm.reduce_scatter

    def take(self):
        grad = saved_take(self)
        if grad is not None:
            taken.append(weakref.ref(grad))
        return grad

    def reduce_scatter(self, output, *args, **kw):
        alive_at_issue.append(sum(ref() is not None for ref in taken))
        taken.clear()
        return saved_rs(self, output, *args, **kw)

    ShardedParam.take_unsharded_grad, Comm.reduce_scatter = take, reduce_scatter
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
        ShardedParam.take_unsharded_grad, Comm.reduce_scatter = saved_take, saved_rs
    return alive_at_issue


@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
def test_gradients_are_freed_once_packed(run_ranks, shm):
    """A unit's unsharded gradients are freed once packed into the reduce-scatter input,
    before its output is allocated: the two are never held together, and the output can
    take the gradients' memory (param-heavy: peak RSS about 80 MiB lower)."""
    for alive in run_ranks(2, gradients_freed_before_reduce, shm):
        assert len(alive) == 6  # 3 units x 2 steps, each with several gradients packed
        assert alive == [0] * 6


def test_a_pending_handle_is_not_done():
    """``Handle.done`` is a property: a reduction recycles its pack at once only when the
    collective really ran in line (a method object would always read as true)."""
    from hyperfsdp_core.comm import READY, Handle

    class Work:
        def wait(self):
            return None

    pending = Handle(work=Work())
    assert pending.done is False
    pending.wait()
    assert pending.done is True and READY.done is True


def test_a_waited_handle_holds_no_buffer():
    """Once waited for, a ``Handle`` keeps no reference to the buffers of its collective
    (neither ``keepalive`` nor the tensor its failure note would name): a reduce-scatter
    input that is a unit's own gradient is freed when the reduction lets it go, not when
    the reduction object itself goes."""
    import weakref

    from hyperfsdp_core.comm import Handle

    class Work:
        def wait(self):
            return None

    buf = torch.ones(4)
    handle = Handle(work=Work(), keepalive=(buf,), what=("reduce_scatter", "unit", buf, None))
    ref = weakref.ref(buf)
    del buf
    assert ref() is not None  # pending: the collective may still read it
    handle.wait()
    assert ref() is None
