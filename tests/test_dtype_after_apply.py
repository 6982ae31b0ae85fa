"""Dtypes after ``model.to(dtype)`` / ``half()`` / ``float()`` on a sharded model.

FSDP2 derives a parameter's compute and reduce dtypes from the policy and the
parameter's dtype: a policy's ``None`` follows the parameter, a dtype it names stays.
So ``MixedPrecisionPolicy(reduce_dtype=torch.float32)`` and then ``model.to(bf16)``
all-gathers in bf16 and still reduces gradients in fp32. Each case records the dtype
of the unsharded parameters the forward sees, of the reduce-scatter's input and of the
sharded gradients, on hyperfsdp and on torch's FSDP2 running the same script (for
conversions before the first forward: FSDP2 decides dtypes at lazy init and fails a
conversion after it), and trains against the unsharded reference.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.utils.parametrize as parametrize
from torch import nn

from hyperfsdp_core.comm import Comm
from hyperfsdp_core.testing.reference import MLPStack, full, mlp_batch

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DIMS = [8, 16, 6]  # 6 rows: uneven over 4 ranks

# case -> (policy kwargs, conversions, expected (sharded, compute, reduce) dtypes)
CASES = {
    "reduce_f32-to_bf16": ({"reduce_dtype": F32}, ["bf16"], (BF16, BF16, F32)),
    "reduce_f32-to_bf16-to_f32": ({"reduce_dtype": F32}, ["bf16", "f32"], (F32, F32, F32)),
    "param_bf16_reduce_f32-to_bf16": (
        {"param_dtype": BF16, "reduce_dtype": F32},
        ["bf16"],
        (BF16, BF16, F32),
    ),
    "param_bf16_reduce_f32-to_bf16-to_f32": (
        {"param_dtype": BF16, "reduce_dtype": F32},
        ["bf16", "f32"],
        (F32, BF16, F32),
    ),
    "param_f32-to_bf16": ({"param_dtype": F32}, ["bf16"], (BF16, F32, F32)),
    "param_bf16-half": ({"param_dtype": BF16}, ["half"], (F16, BF16, BF16)),
    "param_bf16-half-float": ({"param_dtype": BF16}, ["half", "float"], (F32, BF16, BF16)),
    "no_policy-to_bf16": ({}, ["bf16"], (BF16, BF16, BF16)),
}

_CONVERT = {
    "bf16": lambda m: m.to(BF16),
    "f32": lambda m: m.to(F32),
    "half": lambda m: m.half(),
    "float": lambda m: m.float(),
}

# hyperfsdp's reduce-scatters are issued here (whichever transport carries them); FSDP2's
# at torch.distributed (reduce_scatter_single from torch 2.13, reduce_scatter_tensor
# before); (owner, name, index of the input among the arguments)
_RS_SITES = {
    "hyperfsdp": (Comm, "reduce_scatter", 2),
    "fsdp2": (
        dist,
        "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor",
        1,
    ),
}


class ReduceDtypes:
    """Records the dtype of every reduce-scatter's input, on hyperfsdp or FSDP2."""

    def __init__(self, impl: str) -> None:
        self.impl = impl
        self.dtypes: set[torch.dtype] = set()
        self._orig: dict[str, object] = {}

    def __enter__(self):
        owner, name, at = _RS_SITES["hyperfsdp" if self.impl == "hyperfsdp" else "fsdp2"]
        fn = getattr(owner, name)
        self._orig = {name: (owner, fn)}
        setattr(owner, name, self._wrap(fn, at))
        return self

    def __exit__(self, *exc) -> None:
        for name, (owner, fn) in self._orig.items():
            setattr(owner, name, fn)

    def _wrap(self, fn, at: int):
        def call(*args, **kwargs):
            inp = args[at] if len(args) > at else kwargs.get("input", kwargs.get("inp"))
            self.dtypes.add(inp.dtype)
            return fn(*args, **kwargs)

        return call


class _Cast(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, w):
        return w.to(self.dtype)


def _reference_like(ref: nn.Module, compute: torch.dtype) -> None:
    """Make the unsharded reference compute in ``compute`` (differentiably, like a unit's
    all-gather in ``param_dtype``) while its parameters keep their dtype."""
    for sub in list(ref.modules()):
        for name, p in list(sub.named_parameters(recurse=False)):
            if p.dtype != compute:
                parametrize.register_parametrization(sub, name, _Cast(compute), unsafe=True)


def _fully_shard(impl):
    if impl == "hyperfsdp":
        from hyperfsdp_core import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def _train_step(model, ref, opt, ropt, step, compute, recorder):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, _ = mlp_batch(step, 8, DIMS[0])
    x = x.to(compute)
    ref_loss = ref(x).float().pow(2).mean()
    ref_loss.backward()
    with recorder:
        loss = model(x.chunk(world)[rank]).float().pow(2).mean()
        loss.backward()
    grad_dtypes = {p.grad.dtype for p in model.parameters()}
    opt.step(), ropt.step(), opt.zero_grad(), ropt.zero_grad()
    avg = loss.detach().clone()
    dist.all_reduce(avg)
    return avg.item() / world, ref_loss.item(), grad_dtypes


def rank_dtypes_after_conversion(impl, case, when):
    policy_kwargs, conversions, (sharded, compute, _) = CASES[case]
    fully_shard, Policy = _fully_shard(impl)
    torch.manual_seed(0)
    model = MLPStack(DIMS)
    ref = copy.deepcopy(model)
    policy = Policy(**policy_kwargs)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    seen: set[torch.dtype] = set()
    for layer in model.layers:  # after the unit's own pre-hook: the unsharded parameter
        layer.register_forward_pre_hook(lambda m, args: seen.add(m.weight.dtype))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    if when == "after_step":  # lazy init done, trained once in the original dtypes
        first = _train_step(model, ref, opt, ropt, 0, F32, ReduceDtypes(impl))
        losses.append(first[:2])
    for c in conversions:
        _CONVERT[c](model)
        _CONVERT[c](ref)
    _reference_like(ref, compute)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    seen.clear()
    recorder = ReduceDtypes(impl)
    grads: set[torch.dtype] = set()
    for step in (1, 2):
        loss, ref_loss, g = _train_step(model, ref, opt, ropt, step, compute, recorder)
        losses.append((loss, ref_loss))
        grads |= g
    low = max(torch.finfo(compute).eps, torch.finfo(sharded).eps) > 1e-4
    tol = {"atol": 2e-2, "rtol": 2e-2} if low else {"atol": 1e-5, "rtol": 1e-4}
    for loss, ref_loss in losses:
        assert math.isclose(loss, ref_loss, rel_tol=tol["rtol"], abs_tol=tol["atol"])
    ref_params = dict(ref.named_parameters())
    final = {}
    for name, p in model.named_parameters():
        value = full(p.detach())
        assert value.dtype == sharded, name
        key = name.replace(".weight", ".parametrizations.weight.original").replace(
            ".bias", ".parametrizations.bias.original"
        )
        expected = ref_params.get(name, ref_params.get(key))
        torch.testing.assert_close(value.float(), expected.detach().float(), **tol)
        final[name] = value
    return {
        "compute": seen,
        "reduce": recorder.dtypes,
        "grads": grads,
        "losses": [loss for loss, _ in losses],
        "final": final,
    }


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world", [2, 4])
def test_dtypes_follow_policy_after_conversion(run_ranks, world, case):
    """Converted after ``fully_shard``, before the first forward: as FSDP2 does."""
    _, _, (sharded, compute, reduce) = CASES[case]
    ours = run_ranks(world, rank_dtypes_after_conversion, "hyperfsdp", case, "before_init")
    theirs = run_ranks(world, rank_dtypes_after_conversion, "fsdp2", case, "before_init")
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert b["reduce"] == {reduce} and b["compute"] == {compute}, f"FSDP2 {rank}: {b}"
        assert a["compute"] == {compute}, f"rank {rank}: all-gathered in {a['compute']}"
        assert a["reduce"] == {reduce}, f"rank {rank}: reduced in {a['reduce']}"
        assert a["grads"] == b["grads"] == {sharded}
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-3, abs=1e-5)
        for name, value in a["final"].items():
            torch.testing.assert_close(value, b["final"][name], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "case", ["reduce_f32-to_bf16", "param_bf16_reduce_f32-to_bf16-to_f32", "param_bf16-half"]
)
@pytest.mark.parametrize("world", [2, 4])
def test_dtypes_follow_policy_after_training(run_ranks, world, case):
    """Converted after a training step (lazy init done). FSDP2 fixed its dtypes at lazy
    init and fails the next forward ("Expected out tensor to have dtype BFloat16, but got
    float"), so only the unsharded reference is the judge."""
    _, _, (sharded, compute, reduce) = CASES[case]
    for rank, a in enumerate(
        run_ranks(world, rank_dtypes_after_conversion, "hyperfsdp", case, "after_step")
    ):
        assert a["compute"] == {compute}, f"rank {rank}: all-gathered in {a['compute']}"
        assert a["reduce"] == {reduce}, f"rank {rank}: reduced in {a['reduce']}"
        assert a["grads"] == {sharded}
