"""FSDP2's all-gather extension where PyTorch's own FSDP2 tests use it (on CPU here):

* a tensor-subclass parameter created on the meta device: ``fully_shard`` shards it on
  meta, ``to_empty`` materializes it, and it trains as FSDP2's does (torch's test
  subclass ``TwoTensor`` with the extension on its class, both ``fsdp_pre_all_gather``
  signatures, mixed precision);
* ``fsdp_pre_all_gather``/``fsdp_post_all_gather`` attached to a sharded parameter's local
  tensor after ``fully_shard`` (``param._local_tensor.fsdp_pre_all_gather = ...``, as
  PyTorch's monkey-patch and HSDP-mesh tests do): they are called at every unshard, with
  only the shard mesh under HSDP, and the model trains as FSDP2's does.

Each case runs the same script under hyperfsdp and under torch's FSDP2 and compares.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

STEPS = 3
DIM = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _fully_shard(impl: str):
    if impl == "hyperfsdp":
        from hyperfsdp_core import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    return fully_shard


def _train(model: nn.Module) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(7 + dist.get_rank())
    x = torch.randn(4, DIM)
    losses = []
    for _ in range(STEPS):
        loss = model(x).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# -- a subclass parameter on the meta device -------------------------------------------------
def _two_pre_short(self, mesh):
    return (self.a, self.b), None


def _two_pre_long(self, mesh, outer_size, outer_stride, module, mp_policy):
    assert tuple(outer_size) == tuple(module.weight.shape)
    return (self.a, self.b), None


def _two_post(self, outputs, metadata, param_dtype, *, out=None):
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = outputs
    if out is None:
        return TwoTensor(a, b).to(param_dtype), (a, b)
    if a.dtype == param_dtype:  # no cast: ``out`` is built on the same outputs
        assert out.a.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    else:
        out.a.copy_(a)
        out.b.copy_(b)
    return None


def meta_subclass_training(impl: str, signature: str, raf: bool):
    """``TwoTensor`` weights with the extension on the class, made on meta, sharded there,
    materialized by ``to_empty`` and initialized; three steps under bf16 compute."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.two_tensor import TwoTensor

    fully_shard = _fully_shard(impl)
    TwoTensor.fsdp_pre_all_gather = _two_pre_short if signature == "mesh" else _two_pre_long
    TwoTensor.fsdp_post_all_gather = _two_post
    try:
        with torch.device("meta"):
            model = nn.Sequential(Block(), Block())
            for lin in (m for m in model.modules() if isinstance(m, nn.Linear)):
                lin.weight = nn.Parameter(TwoTensor(lin.weight, lin.weight.clone()))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in model:
            fully_shard(block, reshard_after_forward=raf, mp_policy=mp)
        fully_shard(model, reshard_after_forward=raf, mp_policy=mp)
        assert all(p.device.type == "meta" for p in model.parameters())
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.trunc_normal_(p)
        weight = model[0].up.weight
        assert isinstance(weight, DTensor) and isinstance(weight._local_tensor, TwoTensor)
        return _train(model)
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


@pytest.mark.parametrize("raf", [True, False])
@pytest.mark.parametrize("signature", ["mesh", "full"])
@pytest.mark.parametrize("world", [2, 4])
def test_meta_subclass_parameter_trains_as_fsdp2(run_ranks, world, signature, raf):
    ours = run_ranks(world, meta_subclass_training, "hyperfsdp", signature, raf)
    theirs = run_ranks(world, meta_subclass_training, "fsdp2", signature, raf)
    assert ours == theirs


def unmaterialized_subclass_forward() -> str:
    """``TwoTensor`` weights sharded on meta and never materialized: the first forward
    names them (with the plain parameters left on meta)."""
    from torch.testing._internal.two_tensor import TwoTensor

    from hyperfsdp_core import fully_shard

    TwoTensor.fsdp_pre_all_gather = _two_pre_short
    TwoTensor.fsdp_post_all_gather = _two_post
    try:
        with torch.device("meta"):
            model = nn.Sequential(Block(), nn.Linear(DIM, DIM, bias=False))
            model[0].up.weight = nn.Parameter(TwoTensor(model[0].up.weight, model[0].up.weight))
        for module in (model[0], model):
            fully_shard(module)
        with pytest.raises(RuntimeError, match="still on the meta device") as info:
            model(torch.randn(2, DIM))
        return str(info.value)
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


def test_an_unmaterialized_subclass_parameter_is_named_at_the_first_forward(run_ranks):
    (message, _) = run_ranks(2, unmaterialized_subclass_forward)
    assert "0.up.weight" in message  # the extension parameter (its own payload)
    assert "0.down.weight" in message and "1.weight" in message  # the flat ones


# -- methods attached to the local tensor after fully_shard ----------------------------------
class _Calls:
    meshes: list = []  # the (ndim, size) of each mesh fsdp_pre_all_gather got
    posts = 0


def _bf16_pre(self, mesh, outer_size, outer_stride, module, mp_policy):
    _Calls.meshes.append((mesh.ndim, mesh.size()))
    return (self.to(torch.bfloat16),), None


def _bf16_post(self, outputs, metadata, param_dtype, *, out=None):
    from torch.autograd.grad_mode import _unsafe_preserve_version_counter

    _Calls.posts += 1
    (gathered,) = outputs
    with torch.no_grad():
        if out is None:
            full = gathered.to(param_dtype)
            return full, (gathered, full)
        with _unsafe_preserve_version_counter(out):
            out.copy_(gathered)
    return None


def _attach(model: nn.Module) -> int:
    """Give every weight's local tensor the bf16 pair, as instance methods."""
    n = 0
    for name, param in model.named_parameters():
        if name.endswith("weight"):
            local = param._local_tensor
            local.fsdp_pre_all_gather = _bf16_pre.__get__(local)
            local.fsdp_post_all_gather = _bf16_post.__get__(local)
            n += 1
    return n


def attached_after_fully_shard(impl: str, raf: bool, on_meta: bool, hsdp: bool):
    """Plain weights (the extension needs no subclass), the bf16 pair attached to their
    local tensors after ``fully_shard`` (and after ``to_empty`` when made on meta)."""
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = _fully_shard(impl)
    _Calls.meshes, _Calls.posts = [], 0
    world = dist.get_world_size()
    mesh = (
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else init_device_mesh("cpu", (world,))
    )
    torch.manual_seed(0)
    with torch.device("meta" if on_meta else "cpu"):
        model = nn.Sequential(Block(), Block(), nn.Linear(DIM, DIM))
    for block in model[:2]:
        fully_shard(block, mesh=mesh, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    if on_meta:
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.trunc_normal_(p)
    attached = _attach(model)
    losses = _train(model)
    return losses, attached, sorted(set(_Calls.meshes)), len(_Calls.meshes), _Calls.posts


def _check_attached(run_ranks, world, *args):
    ours = run_ranks(world, attached_after_fully_shard, "hyperfsdp", *args)
    theirs = run_ranks(world, attached_after_fully_shard, "fsdp2", *args)
    for (losses, attached, meshes, pres, posts), mine in zip(theirs, ours):
        assert attached == 5 and pres > 0 and posts > 0
        # called as often, with the same meshes, and the same training
        assert mine == (losses, attached, meshes, pres, posts), (mine, losses)
    return ours


@pytest.mark.parametrize("raf", [True, False])
@pytest.mark.parametrize("on_meta", [True, False])
@pytest.mark.parametrize("world", [2, 4])
def test_methods_attached_after_fully_shard_are_used(run_ranks, world, on_meta, raf):
    ours = _check_attached(run_ranks, world, raf, on_meta, False)
    assert all(meshes == [(1, world)] for _, _, meshes, _, _ in ours)


@pytest.mark.parametrize("world", [2, 4])
def test_attached_methods_get_the_shard_mesh_under_hsdp(run_ranks, world):
    ours = _check_attached(run_ranks, world, True, False, True)
    # only the shard mesh, as FSDP2 passes it
    assert all(meshes == [(1, world // 2)] for _, _, meshes, _, _ in ours)


def _batch(rank: int) -> torch.Tensor:
    torch.manual_seed(7 + rank)
    return torch.randn(4, DIM)


def attached_then_rebuilt():
    """The bf16 pair attached after ``fully_shard``, one step, then the sharded
    parameters replaced (``load_state_dict(assign=True)``: new local tensor objects,
    without the methods) and two more steps. Checked against one process that rounds
    its weights to bf16 in the first step only; returns the unshards that used the
    methods before and after the load. (FSDP2 fails here: its all-gather buffers keep
    the extension's bf16 dtype.)"""
    import copy

    from torch.func import functional_call

    from hyperfsdp_core import fully_shard

    _Calls.meshes, _Calls.posts = [], 0
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    ref = copy.deepcopy(model)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    _attach(model)
    calls = []
    for step in range(3):
        if step == 1:
            calls.append(len(_Calls.meshes))
            model.load_state_dict(model.state_dict(), assign=True)
        loss = model(_batch(rank)).pow(2).sum()
        loss.backward()
        ref_params = dict(ref.named_parameters())
        if step == 0:  # the extension's round trip through bf16
            ref_params = {
                n: p.to(torch.bfloat16).float() if n.endswith("weight") else p
                for n, p in ref_params.items()
            }
            for t in ref_params.values():
                t.retain_grad()
        ref_losses = [
            functional_call(ref, ref_params, (_batch(r),)).pow(2).sum() for r in range(world)
        ]
        (sum(ref_losses) / world).backward()
        assert torch.allclose(loss.detach(), ref_losses[rank].detach(), rtol=1e-5), step
        with torch.no_grad():
            for (name, p), rp in zip(model.named_parameters(), ref.parameters(), strict=True):
                p -= 0.01 * p.grad
                rp -= 0.01 * ref_params[name].grad
        model.zero_grad()
        ref.zero_grad()
        for name, rp in ref.named_parameters():
            assert torch.allclose(model.get_parameter(name).full_tensor(), rp, rtol=1e-5, atol=1e-6)
    calls.append(len(_Calls.meshes) - calls[0])
    return calls


@pytest.mark.parametrize("world", [2, 4])
def test_attached_methods_go_with_their_local_tensor(run_ranks, world):
    for before, after in run_ranks(world, attached_then_rebuilt):
        assert before > 0 and after == 0
