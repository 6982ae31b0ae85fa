"""``load_state_dict`` copies into the sharded storage it finds (as FSDP2 does).

A load that copies (the default) keeps every local shard and every flat sharded buffer
where it was: same ``data_ptr``, the optimizer's parameters and state still the live
ones, even and uneven shards alike. ``assign=True`` adopts new Parameter objects, and
``to_empty`` moves the storage; both keep training like the unsharded reference.
Each scenario also runs on torch's FSDP2, with the same expectations and results.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from hyperfsdp_core.testing.reference import MLPStack, assert_close_params, full, mlp_batch

# 16 and 8 rows split evenly over 2 and 4 ranks; 6 rows are even over 2 ranks and
# uneven over 4 (2, 2, 2, 0), 3 rows uneven over both (2, 1 and 1, 1, 1, 0)
DIMS = {"even": [8, 16, 8], "uneven": [5, 6, 3]}


def _fully_shard(impl):
    if impl == "hyperfsdp":
        from hyperfsdp_core import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    return fully_shard


def _build(impl, dims, seed=0):
    torch.manual_seed(seed)
    model = MLPStack(dims)
    ref = copy.deepcopy(model)
    fully_shard = _fully_shard(impl)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, ref


def _units(model):
    return [m for m in model.modules() if hasattr(m, "reshard")]


def storage_ptrs(model, impl):
    """Every local shard's ``data_ptr``, then every flat sharded buffer's."""
    local = [p.to_local().data_ptr() for p in model.parameters()]
    if impl == "hyperfsdp":
        flat = [
            b.payload.sharded_flat.data_ptr()
            for m in _units(model)
            for b in (m._hyperfsdp_state.group.buckets if m._hyperfsdp_state.group else ())
        ]
    else:
        flat = [
            fp._sharded_param_data.data_ptr()
            for m in _units(model)
            for group in _fsdp2_param_groups(m)
            for fp in group.fsdp_params
        ]
    return local, flat


def _fsdp2_param_groups(module):
    """FSDP2's parameter groups of a unit (a list from torch 2.13, one group before)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return groups
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def padding_is_zero(model, impl):
    if impl != "hyperfsdp":
        return True
    for m in _units(model):
        group = m._hyperfsdp_state.group
        for b in group.buckets if group is not None else ():
            for p, seg in zip(b.params, b.payload.segments):
                pad = b.payload.sharded_flat[
                    seg.offset + p.layout.actual_numel : seg.offset + seg.numel
                ]
                if pad.numel() and bool(pad.ne(0).any()):
                    return False
    return True


def _step(model, ref, opt, ropt, step, dim):
    x, y = mlp_batch(step, 8, dim)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_loss = (ref(x) - y[:, : ref.layers[-1].out_features]).pow(2).mean()
    ref_loss.backward()
    mine = x.chunk(world)[rank], y.chunk(world)[rank]
    loss = (model(mine[0]) - mine[1][:, : ref.layers[-1].out_features]).pow(2).mean()
    loss.backward()
    opt.step(), ropt.step(), opt.zero_grad(), ropt.zero_grad()
    avg = loss.detach().clone()
    dist.all_reduce(avg)
    assert math.isclose(avg.item() / world, ref_loss.item(), rel_tol=1e-4, abs_tol=1e-6)
    return ref_loss.item()


def _sharded_like(model, values):
    """``values`` (full tensors by FQN) as DTensors laid out like ``model``'s parameters."""
    return {
        k: distribute_tensor(values[k], v.device_mesh, v.placements)
        for k, v in model.state_dict().items()
    }


def rank_load_copies_in_place(impl, shapes, path):
    dims = DIMS[shapes]
    model, ref = _build(impl, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = [_step(model, ref, opt, ropt, 0, dims[0])]
    before = storage_ptrs(model, impl)
    params = list(model.parameters())
    torch.manual_seed(1)
    source = {k: v.detach() for k, v in MLPStack(dims).state_dict().items()}
    if path == "state_dict":
        sd = model.state_dict()
        assert all(isinstance(v, DTensor) for v in sd.values())
        model.load_state_dict(_sharded_like(model, source))
    else:  # torch.distributed.checkpoint's state-dict API
        sd = get_model_state_dict(model)
        set_model_state_dict(model, _sharded_like(model, source))
    ref.load_state_dict(source)
    after = storage_ptrs(model, impl)
    # the same Parameter objects, over the same memory; the optimizer holds them
    same_params = all(a is b for a, b in zip(params, model.parameters(), strict=True))
    opt_params = opt.param_groups[0]["params"]
    opt_live = all(a is b for a, b in zip(opt_params, model.parameters(), strict=True)) and all(
        any(s is p for p in model.parameters()) for s in opt.state
    )
    for name, p in model.named_parameters():
        torch.testing.assert_close(full(p.detach()), source[name], atol=0, rtol=0)
    assert padding_is_zero(model, impl)
    for step in (1, 2):
        losses.append(_step(model, ref, opt, ropt, step, dims[0]))
    assert_close_params(model, ref)
    final = {k: full(v.detach()) for k, v in model.named_parameters()}
    return {
        "local_same": before[0] == after[0],
        "flat_same": before[1] == after[1],
        "same_params": same_params,
        "opt_live": opt_live,
        "losses": losses,
        "final": final,
    }


@pytest.mark.parametrize("path", ["state_dict", "dcp"])
@pytest.mark.parametrize("shapes", ["even", "uneven"])
@pytest.mark.parametrize("world", [2, 4])
def test_load_state_dict_copies_into_existing_storage(run_ranks, world, shapes, path):
    ours = run_ranks(world, rank_load_copies_in_place, "hyperfsdp", shapes, path)
    theirs = run_ranks(world, rank_load_copies_in_place, "fsdp2", shapes, path)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert b["local_same"] and b["flat_same"], f"FSDP2 rank {rank}: {b}"
        assert a["local_same"], f"rank {rank}: a local shard got new storage"
        assert a["flat_same"], f"rank {rank}: a flat sharded buffer was replaced"
        assert a["same_params"] and a["opt_live"], rank
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5, abs=1e-7)
        for name, value in a["final"].items():
            torch.testing.assert_close(value, b["final"][name], atol=1e-5, rtol=1e-4)


def rank_assign_and_to_empty(impl, shapes):
    """``assign=True`` adopts the loaded Parameters; ``to_empty`` + init moves the storage;
    both train like the reference afterwards."""
    dims = DIMS[shapes]
    model, ref = _build(impl, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _step(model, ref, opt, ropt, 0, dims[0])
    old = list(model.parameters())
    torch.manual_seed(1)
    source = {k: v.detach() for k, v in MLPStack(dims).state_dict().items()}
    loaded = {k: torch.nn.Parameter(v) for k, v in _sharded_like(model, source).items()}
    model.load_state_dict(loaded, assign=True)
    ref.load_state_dict(source)
    adopted = all(p is loaded[k] for k, p in model.named_parameters())
    replaced = all(a is not b for a, b in zip(old, model.parameters()))
    for name, p in model.named_parameters():
        torch.testing.assert_close(full(p.detach()), source[name], atol=0, rtol=0)
    assert padding_is_zero(model, impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = [_step(model, ref, opt, ropt, step, dims[0]) for step in (1, 2)]
    assert_close_params(model, ref)
    # to_empty, then an in-place init of every sharded parameter
    before = storage_ptrs(model, impl)
    model.to_empty(device="cpu")
    torch.manual_seed(2)
    fresh = {k: v.detach() for k, v in MLPStack(dims).state_dict().items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(fresh[name], p.device_mesh, p.placements))
    ref.load_state_dict(fresh)
    # every non-empty shard has new memory (a rank whose shards are all empty has none)
    nonempty = [i for i, p in enumerate(model.parameters()) if p.to_local().numel()]
    moved = all(storage_ptrs(model, impl)[0][i] != before[0][i] for i in nonempty)
    assert padding_is_zero(model, impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses += [_step(model, ref, opt, ropt, step, dims[0]) for step in (3, 4)]
    assert_close_params(model, ref)
    return {"adopted": adopted, "replaced": replaced, "moved": moved, "losses": losses}


@pytest.mark.parametrize("shapes", ["even", "uneven"])
@pytest.mark.parametrize("world", [2, 4])
def test_assign_and_to_empty_still_work(run_ranks, world, shapes):
    ours = run_ranks(world, rank_assign_and_to_empty, "hyperfsdp", shapes)
    theirs = run_ranks(world, rank_assign_and_to_empty, "fsdp2", shapes)
    for a, b in zip(ours, theirs):
        assert a["adopted"] and a["replaced"] and a["moved"], a
        assert b["replaced"], b
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5, abs=1e-7)


def rank_load_while_unsharded(impl, shapes):
    """A load while the units hold unsharded parameters (``reshard_after_forward=False``
    after a forward, or ``unshard()``) lands in the sharded storage, as FSDP2's does."""
    dims = DIMS[shapes]
    model, ref = _build(impl, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _step(model, ref, opt, ropt, 0, dims[0])
    before = storage_ptrs(model, impl)
    torch.manual_seed(1)
    source = {k: v.detach() for k, v in MLPStack(dims).state_dict().items()}
    sd = _sharded_like(model, source)
    for unit in _units(model):
        unit.set_reshard_after_forward(False)
    with torch.no_grad():
        model(torch.zeros(2, dims[0]))  # every unit stays unsharded
    model.load_state_dict(sd)
    ref.load_state_dict(source)
    assert storage_ptrs(model, impl) == before
    for name, p in model.named_parameters():
        torch.testing.assert_close(full(p.detach()), source[name], atol=0, rtol=0)
    losses = [_step(model, ref, opt, ropt, step, dims[0]) for step in (1, 2)]
    assert_close_params(model, ref)
    return losses


@pytest.mark.parametrize("shapes", ["even", "uneven"])
@pytest.mark.parametrize("world", [2, 4])
def test_load_while_unsharded(run_ranks, world, shapes):
    ours = run_ranks(world, rank_load_while_unsharded, "hyperfsdp", shapes)
    theirs = run_ranks(world, rank_load_while_unsharded, "fsdp2", shapes)
    for a, b in zip(ours, theirs):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
