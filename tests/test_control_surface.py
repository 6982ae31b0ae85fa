"""FSDPModule methods FSDP2 users call: unshard/reshard, prefetch lists, gradient accumulation,
resharding policies, unused parameters, hooks, shared communication contexts."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hyperfsdp_core import (
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from hyperfsdp_core.testing import shared_memory
from hyperfsdp_core.testing.counting import CollectiveCounter
from hyperfsdp_core.testing.reference import (
    MLPStack,
    Transformer,
    assert_close_params,
    full,
    lm_loss,
    local_slice,
    mlp_batch,
    mse_loss,
    token_batch,
)

Count = CollectiveCounter


def shard_layers(model, **kwargs):
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model)
    return model


def pair(dims=(6, 9, 7, 5, 3)):
    torch.manual_seed(0)
    model = MLPStack(list(dims))
    return model, copy.deepcopy(model)


def step_both(model, ref, opt, ref_opt, step, dim=6):
    x, y = mlp_batch(step, 4, dim)
    mse_loss(model(local_slice(x)), local_slice(y)).backward()
    mse_loss(ref(x), y).backward()
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()


# -- unshard / reshard / forward methods ---------------------------------------------------------


def explicit_unshard():
    model, ref = pair()
    shard_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model(torch.randn(1, 6))  # lazy init
    model.reshard()
    out = {}
    handle = model.layers[0].unshard(async_op=True)
    out["handle"] = isinstance(handle, UnshardHandle)
    # no wait(): the pre-forward waits on the pending unshard
    step_both(model, ref, opt, ref_opt, 0)
    handle = model.layers[1].unshard(async_op=True)
    handle.wait()
    w = model.layers[1].weight
    out["unsharded_registered"] = not isinstance(w, DTensor) and tuple(w.shape) == (7, 9)
    model.layers[1].reshard()
    out["resharded"] = isinstance(model.layers[1].weight, DTensor)
    assert model.layers[2].unshard() is None  # async_op=False waits inside
    out["sync_unsharded"] = not isinstance(model.layers[2].weight, DTensor)
    step_both(model, ref, opt, ref_opt, 1)
    assert_close_params(model, ref)
    return out


def test_unshard_async_and_reshard(run_ranks):
    for out in run_ranks(2, explicit_unshard):
        assert out == {
            "handle": True,
            "unsharded_registered": True,
            "resharded": True,
            "sync_unsharded": True,
        }


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)

    def generate(self, x):
        return self.proj.weight.sum() + self.proj(x).sum()  # uses the parameter directly


def forward_method():
    model = Generator()
    ref = copy.deepcopy(model)
    fully_shard(model)
    register_fsdp_forward_method(model, "generate")
    register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not sharded: a no-op
    x = torch.randn(2, 4)
    got = model.generate(x)
    return torch.allclose(got, ref.generate(x)), isinstance(model.proj.weight, DTensor)


def test_register_fsdp_forward_method(run_ranks):
    # the root keeps its parameters unsharded after forward, so the weight is plain after
    for ok, still_dtensor in run_ranks(2, forward_method):
        assert ok and not still_dtensor


# -- explicit prefetching --------------------------------------------------------------------------


def prefetch_depth(depth, shm):
    with shared_memory(shm):
        return _prefetch_depth(depth)


def _prefetch_depth(depth):
    model, ref = pair((6, 8, 8, 8, 8, 8, 3))
    shard_layers(model)
    layers = list(model.layers)
    if depth:
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + depth])
            layer.set_modules_to_backward_prefetch(layers[max(0, i - depth) : i][::-1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    peak = [0]
    groups = [layer._hyperfsdp_state.group for layer in layers]
    orig = type(groups[0]).unshard

    def unshard(self, comm):
        orig(self, comm)
        held = sum(1 for g in groups if not g.is_sharded)
        peak[0] = max(peak[0], held)

    type(groups[0]).unshard = unshard
    try:
        for step in range(3):
            step_both(model, ref, opt, ref_opt, step)
    finally:
        type(groups[0]).unshard = orig
    assert_close_params(model, ref)
    return peak[0]


@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
def test_explicit_prefetch_lists(run_ranks, shm):
    default = run_ranks(2, prefetch_depth, 0, shm)[0]
    deeper = run_ranks(2, prefetch_depth, 2, shm)[0]
    if shm:
        # gathers run in line: no implicit prefetch, one unit gathered at a time; explicit
        # lists are still honoured (two modules ahead: three units gathered at once)
        assert (default, deeper) == (1, 3)
    else:
        # two modules ahead keep one more unit's parameters gathered (more memory, more
        # overlap) than the implicit one-ahead prefetch
        assert deeper == default + 1 == 3, (default, deeper)


# -- gradient accumulation and resharding policies ---------------------------------------------------


def accumulate(use_is_last_backward):
    model, ref = pair()
    shard_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rs_per_micro = []
    for step in range(2):
        for micro in range(3):
            last = micro == 2
            model.set_requires_gradient_sync(last)
            if use_is_last_backward:
                model.set_is_last_backward(last)
            x, y = mlp_batch(10 * step + micro, 4, 6)
            with Count() as c:
                mse_loss(model(local_slice(x)), local_slice(y)).backward()
            rs_per_micro.append(c.count("rs"))
            mse_loss(ref(x), y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_close_params(model, ref)
    return rs_per_micro


@pytest.mark.parametrize("use_is_last_backward", [False, True])
def test_gradient_accumulation_without_sync(run_ranks, use_is_last_backward):
    for counts in run_ranks(2, accumulate, use_is_last_backward):
        assert (
            counts == [0, 0, 4] * 2
        )  # only the synced micro-batch reduces (4 units; the root has no params)


def reshard_policies():
    model, ref = pair()
    shard_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, _ = mlp_batch(0, 4, 6)
    out = {}
    with Count() as c:
        step_both(model, ref, opt, ref_opt, 0)
    out["default"] = c.count("ag")
    model.set_reshard_after_backward(False)
    x1, y1 = mlp_batch(1, 4, 6)
    mse_loss(model(local_slice(x1)), local_slice(y1)).backward()  # a micro-batch, no step yet
    with Count() as c:  # parameters are still unsharded from that backward
        loss = mse_loss(model(local_slice(x)), None)
    loss.backward()
    out["forward_after_no_reshard_after_backward"] = c.count("ag")
    model.set_reshard_after_backward(True)
    opt.zero_grad()
    model.reshard()
    for layer in model.layers:
        layer.reshard()
    # evaluation without resharding after forward, then back to training
    model.set_reshard_after_forward(False)
    with torch.no_grad(), Count() as c:
        model(local_slice(x))
        model(local_slice(x))
    out["eval_two_forwards"] = c.count("ag")
    model.set_reshard_after_forward(True)
    with Count() as c:
        step_both(model, ref, opt, ref_opt, 2)
    out["train_again"] = c.count("ag")
    assert_close_params(model, ref)
    return out


def test_reshard_after_backward_and_forward_at_runtime(run_ranks):
    for out in run_ranks(2, reshard_policies):
        assert out == {
            "default": 8,  # 4 units: forward + backward
            "forward_after_no_reshard_after_backward": 0,
            "eval_two_forwards": 4,  # gathered once, kept for the second forward
            "train_again": 4,  # still gathered from evaluation; re-gathered for backward
        }


def reshard_to_smaller_group():
    torch.manual_seed(0)
    model = Transformer(vocab=33, dim=16, n_layers=2, hidden=20)
    ref = copy.deepcopy(model)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=2)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    calls = []
    held = []
    for step in range(3):
        x, y = token_batch(step, 8, 5, 33)
        with Count() as c:
            out = model(local_slice(x))
            bucket = model.layers[0]._hyperfsdp_state.group.buckets[0]
            kept = bucket.payload._pf.flat if str(bucket.state) == "post_forward" else None
            held.append(
                (kept.numel(), bucket.world * bucket.payload.total) if kept is not None else None
            )
            lm_loss(out, local_slice(y)).backward()
        calls.append(sorted(set(c.calls)))
        lm_loss(ref(x), y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_close_params(model, ref)
    return calls[-1], held[-1], [c for c in calls[-1] if c[0] == "ag"]


def test_reshard_after_forward_int(run_ranks):
    for _calls, (kept, full_numel), gathers in run_ranks(4, reshard_to_smaller_group):
        assert kept * 2 == full_numel  # half of the unsharded parameters kept between passes
        # forward gathers over all 4 ranks; backward re-gathers over groups of 2
        assert {("ag", 4, None), ("ag", 2, None)} <= set(gathers)


# -- unused parameters, unshard_in_backward, frozen parameters ----------------------------------------


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(5, 4)

    def forward(self, x, branch):
        return self.a(x) if branch == 0 else self.b(x)


class Branchy(nn.Module):
    """Rank-dependent control flow: rank r uses branch r % 2 inside one unit."""

    def __init__(self):
        super().__init__()
        self.body = Branches()
        self.head = nn.Linear(4, 2)

    def forward(self, x, branch):
        return self.head(torch.tanh(self.body(x, branch)))


def unused_params():
    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    fully_shard(model.body)
    fully_shard(model)
    model.set_reduce_scatter_unused_params(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(3):
        x = torch.randn(4 * world, 5, generator=torch.Generator().manual_seed(step))
        model(local_slice(x), rank % 2).pow(2).mean().backward()
        # reference: every rank's slice through its own branch, averaged over ranks
        loss = sum(ref(xs, r % 2).pow(2).mean() for r, xs in enumerate(x.chunk(world))) / world
        loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_close_params(model, ref)
    return True


def test_reduce_scatter_unused_params(run_ranks):
    assert run_ranks(2, unused_params) == [True, True]


def no_unshard_in_backward():
    torch.manual_seed(0)
    model = Transformer(vocab=33, dim=16, n_layers=2, hidden=20)
    ref = copy.deepcopy(model)
    fully_shard(model.tok_embeddings)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    counts = []
    for step, flag in enumerate([True, False, False]):
        model.tok_embeddings.set_unshard_in_backward(flag)
        x, y = token_batch(step, 4, 5, 33)
        with Count() as c:
            lm_loss(model(local_slice(x)), local_slice(y)).backward()
        counts.append(c.count("ag"))
        lm_loss(ref(x), y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_close_params(model, ref)
    return counts


def test_unshard_in_backward_false_skips_a_gather(run_ranks):
    for counts in run_ranks(2, no_unshard_in_backward):
        assert counts[1] == counts[0] - 1 == counts[2]


def frozen_params():
    model, ref = pair()
    for m in (model, ref):
        m.layers[1].weight.requires_grad_(False)
        m.layers[2].bias.requires_grad_(False)
    shard_layers(model)
    assert not model.layers[1].weight.requires_grad
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        step_both(model, ref, opt, ref_opt, step)
    assert model.layers[1].weight.grad is None
    assert_close_params(model, ref)
    return True


def test_frozen_and_trainable_params_in_one_unit(run_ranks):
    assert run_ranks(2, frozen_params) == [True, True]


# -- hooks and shared contexts --------------------------------------------------------------------


def all_reduce_hook_sees_reduced_grads():
    model, ref = pair()
    shard_layers(model)
    seen = []

    def hook(output):
        seen.append(output.numel())
        output.mul_(2.0)  # the hook may change the reduced gradient in place

    for layer in model.layers:
        layer.set_all_reduce_hook(hook)
    x, y = mlp_batch(0, 4, 6)
    with Count() as c:
        mse_loss(model(local_slice(x)), local_slice(y)).backward()
    mse_loss(ref(x), y).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    worst = max(
        (full(p.grad) - 2 * ref_grads[n]).abs().max().item() for n, p in model.named_parameters()
    )
    ops = {op for kind, _, op in c.calls if kind == "rs"}
    return len(seen), worst, ops


def test_all_reduce_hook(run_ranks):
    """The hook sees each reduced gradient once (4 units) and what it writes lands; the
    reduce-scatters are plain SUMs (``set_force_sum_reduction_for_comms``, which has no
    effect here, is checked in ``test_fsdp2_behaviour.py``)."""
    for n_calls, worst, ops in run_ranks(2, all_reduce_hook_sees_reduced_grads):
        assert n_calls == 4 and worst < 1e-6
        assert ops == {str(dist.ReduceOp.SUM)}


def shared_comm():
    a, _ = pair()
    b, _ = pair()
    shard_layers(a)
    shard_layers(b)
    share_comm_ctx([a, b])
    for m in (a, b):
        m(torch.randn(2, 6)).sum().backward()
    ca, cb = a._hyperfsdp_state.ctx, b._hyperfsdp_state.ctx
    return ca is not cb, ca.comm is cb.comm, ca.comm.stats.reduce_scatters


def test_share_comm_ctx(run_ranks):
    for separate_ctx, same_comm, reduce_scatters in run_ranks(2, shared_comm):
        assert separate_ctx and same_comm and reduce_scatters == 8


def kept_unsharded_across_optimizer_step():
    """reshard_after_backward=False across an optimizer step must not compute with stale values."""
    model, ref = pair()
    shard_layers(model)
    model.set_reshard_after_backward(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    outputs = []
    for step in range(3):
        x, _ = mlp_batch(100 + step, 4, 6)
        with torch.no_grad():  # forwards right after an optimizer step use the new values
            outputs.append((model(local_slice(x)) - local_slice(ref(x))).abs().max().item())
        step_both(model, ref, opt, ref_opt, step)
    for layer in model.layers:
        layer.reshard()  # kept unsharded after backward: register the sharded parameters
    assert_close_params(model, ref)
    assert max(outputs) < 1e-5, outputs
    return True


def test_kept_unsharded_params_are_refreshed_after_optimizer_step(run_ranks):
    assert run_ranks(2, kept_unsharded_across_optimizer_step) == [True, True]


class RecordingAllGather:
    """An FSDP2-style custom all-gather: allocates its own buffers, calls the collective."""

    def __init__(self):
        self.allocated, self.calls = [], 0

    def allocate(self, size, *, dtype, device):
        self.allocated.append(tuple(size))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(
            output_tensor, input_tensor, group=group, async_op=async_op
        )


class RecordingReduceScatter(RecordingAllGather):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def custom_comms_and_groups():
    model, ref = pair()
    shard_layers(model)
    ag, rs = RecordingAllGather(), RecordingReduceScatter()
    model.layers[1].set_custom_all_gather(ag)
    model.layers[1].set_custom_reduce_scatter(rs)
    model.set_separate_reduce_scatter_group(True)
    model.set_reduce_scatter_max_input_buffers(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with Count() as c:
        for step in range(2):
            step_both(model, ref, opt, ref_opt, step)
    assert_close_params(model, ref)
    bucket = model.layers[0]._hyperfsdp_state.group.buckets[0]
    separate = (
        bucket.reduce_group is not None and bucket.reduce_group is not bucket.mesh_info.shard_group
    )
    # the layers[1] collectives went through the custom objects, not hyperfsdp's own calls
    return ag.calls, rs.calls, len(ag.allocated), separate, c.count("ag"), c.count("rs")


def test_custom_comms_separate_group_and_buffers(run_ranks):
    for ag_calls, rs_calls, allocations, separate, own_ag, own_rs in run_ranks(
        2, custom_comms_and_groups
    ):
        assert (ag_calls, rs_calls, allocations) == (4, 2, 4)  # 2 steps x (forward + backward)
        assert separate
        assert (own_ag, own_rs) == (3 * 4, 3 * 2)
