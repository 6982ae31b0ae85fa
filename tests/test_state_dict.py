"""state_dict round trips, assign=True, meta-device init, module.to / _apply."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing.reference import (
    MLPStack,
    Transformer,
    assert_close_params,
    mlp_batch,
)


def shard(model):
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def flats(model):
    out = []
    for m in model.modules():
        st = getattr(m, "_hyperfsdp_state", None)
        if st is not None and st.group is not None:
            out += [b for b in st.group.buckets if b not in out]
    return out


def padding_is_zero(model):
    for bucket in flats(model):
        for p, seg in zip(bucket.params, bucket.payload.segments):
            lay = p.layout
            pad = bucket.payload.sharded_flat[
                seg.offset + lay.actual_numel : seg.offset + seg.numel
            ]
            if pad.numel() and not bool((pad == 0).all()):
                return False
    return True


def locals_in_flat_storage(model):
    """Every local shard is the memory of its slot in the bucket's flat buffer."""
    for bucket in flats(model):
        flat = bucket.payload.sharded_flat
        for p, seg in zip(bucket.params, bucket.payload.segments):
            local = p.sharded_param.to_local()
            if (
                local.numel()
                and local.data_ptr() != flat.data_ptr() + seg.offset * flat.element_size()
            ):
                return False
    return True


def train_one(model, step=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, _ = mlp_batch(step, 4, 5)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def round_trip(assign):
    torch.manual_seed(0)
    dims = [5, 7, 3, 6]  # uneven rows on 2 and 4 ranks
    source = shard(MLPStack(dims))
    train_one(source)
    sd = source.state_dict()
    assert all(isinstance(v, DTensor) for v in sd.values())
    torch.manual_seed(1)
    target = shard(MLPStack(dims))
    target.load_state_dict(copy.deepcopy(sd) if assign else sd, assign=assign)
    assert_close_params(target, source, atol=0, rtol=0)
    assert locals_in_flat_storage(target) and padding_is_zero(target)
    # both keep training identically
    train_one(source, 1)
    train_one(target, 1)
    assert_close_params(target, source, atol=0, rtol=0)
    return True


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_state_dict_round_trip(run_ranks, world, assign):
    assert run_ranks(world, round_trip, assign) == [True] * world


def meta_init():
    torch.manual_seed(0)
    ref = Transformer(vocab=23, dim=8, n_layers=2, hidden=13)
    with torch.device("meta"):
        model = Transformer(vocab=23, dim=8, n_layers=2, hidden=13)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            # in-place init of each sharded parameter from the reference's values
            p.copy_(distribute_tensor(ref_params[name].detach(), p.device_mesh, p.placements))
    assert locals_in_flat_storage(model)
    assert padding_is_zero(model)
    assert_close_params(model, ref, atol=0, rtol=0)
    # and it trains like the reference
    from hyperfsdp_core.testing.reference import lm_loss, local_slice, token_batch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        x, y = token_batch(step, 4, 5, 23)
        lm_loss(ref(x), y).backward()
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
        opt.step(), ropt.step(), opt.zero_grad(), ropt.zero_grad()
    assert_close_params(model, ref)
    return True


def test_meta_device_init(run_ranks):
    assert run_ranks(2, meta_init) == [True, True]


def nn_init_on_sharded_params():
    """In-place nn.init on the sharded DTensor parameters writes into the flat storage."""
    with torch.device("meta"):
        model = MLPStack([5, 6, 3])
    shard(model)
    model.to_empty(device="cpu")
    for p in model.parameters():
        nn.init.constant_(p, 0.5)
    assert locals_in_flat_storage(model) and padding_is_zero(model)
    out = model(torch.ones(1, 5))
    expected = 0.5 * 6 * (0.5 * 5 + 0.5) + 0.5  # relu(positive) passes through
    return torch.allclose(out, torch.full_like(out, expected))


def test_nn_init_after_to_empty(run_ranks):
    assert run_ranks(2, nn_init_on_sharded_params) == [True, True]


def dtype_and_apply():
    torch.manual_seed(0)
    model = shard(MLPStack([5, 7, 3]))
    ref = MLPStack([5, 7, 3])
    torch.manual_seed(0)
    ref = MLPStack([5, 7, 3])
    model.to(torch.float64)
    ref.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert locals_in_flat_storage(model) and padding_is_zero(model)
    x = torch.randn(4, 5, dtype=torch.float64)
    out = model(x)
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    assert all(p.grad.dtype == torch.float64 for p in model.parameters())
    return True


def test_module_to_dtype_rebuilds_storage(run_ranks):
    assert run_ranks(2, dtype_and_apply) == [True, True]
