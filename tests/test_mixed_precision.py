"""Mixed precision (builtin plugin): bf16 compute / fp32 reduce, mixed dtypes in one unit."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.utils.parametrize as parametrize
from torch import nn

from hyperfsdp_core import MixedPrecisionPolicy, fully_shard
from hyperfsdp_core.testing.counting import CollectiveCounter
from hyperfsdp_core.testing.reference import (
    Transformer,
    full,
    lm_loss,
    local_slice,
    token_batch,
)

BF16 = torch.bfloat16


class Cast(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, w):
        return w.to(self.dtype)


def cast_like_fsdp(module: nn.Module, policy: MixedPrecisionPolicy, skip: tuple = ()) -> None:
    """Make an unsharded ``module`` compute like one mixed-precision unit (the reference).

    Its parameters (except those under the ``skip`` submodules, which are other units)
    are cast to ``param_dtype`` on use, differentiably, so gradients reach the fp32
    originals; inputs and outputs are cast like the unit's.
    """
    skipped = {id(m) for unit in skip for m in unit.modules()}
    targets = [
        (sub, name)
        for sub in module.modules()
        if id(sub) not in skipped
        for name, p in sub.named_parameters(recurse=False)
        if p.is_floating_point() and p.dtype != policy.param_dtype
    ]
    for sub, name in targets:
        parametrize.register_parametrization(sub, name, Cast(policy.param_dtype), unsafe=True)

    def cast_inputs(mod, args, kwargs):
        def cast(x):
            return x.to(policy.param_dtype) if torch.is_tensor(x) and x.is_floating_point() else x

        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    if policy.cast_forward_inputs:
        module.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    if policy.output_dtype is not None:
        module.register_forward_hook(lambda mod, args, out: out.to(policy.output_dtype))


def reference_param(ref, name):
    """A parametrized reference parameter is reached through ``parametrizations``."""
    module_name, _, leaf = name.rpartition(".")
    module = ref.get_submodule(module_name) if module_name else ref
    if parametrize.is_parametrized(module, leaf):
        return module.parametrizations[leaf].original
    return getattr(module, leaf)


POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
ROOT_POLICY = MixedPrecisionPolicy(
    param_dtype=BF16, reduce_dtype=torch.float32, output_dtype=torch.float32
)


def bf16_parity(steps=3):
    torch.manual_seed(0)
    model = Transformer(vocab=41, dim=16, n_layers=2, hidden=27)
    ref = copy.deepcopy(model)
    for block in ref.layers:
        cast_like_fsdp(block, POLICY)
    cast_like_fsdp(ref, ROOT_POLICY, skip=tuple(ref.layers))
    for block in model.layers:
        fully_shard(block, mp_policy=POLICY)
    fully_shard(model, mp_policy=ROOT_POLICY)
    # SGD: parameter differences then track gradient differences (AdamW would amplify
    # bf16 noise on tiny gradients into full-size steps)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    start = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    gaps = []
    for step in range(steps):
        x, y = token_batch(step, 4, 6, 41)
        out = model(local_slice(x))
        assert out.dtype == torch.float32  # output_dtype at the root
        loss = lm_loss(out, local_slice(y))
        loss.backward()
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        for n, p in model.named_parameters():
            assert p.grad.dtype == torch.float32, n  # reduced in fp32, applied to fp32 masters
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        gaps.append(abs(avg.item() / dist.get_world_size() - ref_loss.item()))
    worst = moved = 0.0
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32, n  # masters stay fp32
        r = reference_param(ref, n)
        worst = max(worst, (full(p.detach()) - r.detach()).abs().max().item())
        moved = max(moved, (r.detach() - start[n]).abs().max().item())
    return worst, max(gaps), moved


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_compute_fp32_reduce_parity(run_ranks, world):
    for worst, loss_gap, moved in run_ranks(world, bf16_parity):
        assert moved > 0.1  # training moved the parameters well beyond the tolerance
        assert worst < 1e-2  # bf16 tolerance
        assert loss_gap < 2e-2


class MixedNorm(nn.Module):
    """fp32 norm weights beside bf16 matrices in one unit (FSDP2 rejects this)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)  # fp32
        self.proj = nn.Linear(8, 8, bias=False).to(BF16)
        self.up = nn.Linear(8, 12).to(BF16)

    def forward(self, x):
        h = self.norm(x.to(self.norm.weight.dtype))  # fp32 unless a policy casts the unit
        return self.up(self.proj(h.to(self.proj.weight.dtype)))


class MixedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([MixedNorm(), nn.Linear(12, 8).to(BF16)])

    def forward(self, x):
        h = self.blocks[0](x)
        return self.blocks[1](torch.tanh(h).to(self.blocks[1].weight.dtype)).float()


def mixed_dtypes_in_one_unit(use_policy):
    torch.manual_seed(0)
    model = MixedModel()
    ref = copy.deepcopy(model)
    policy = (
        MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
        if use_policy
        else MixedPrecisionPolicy()
    )
    fully_shard(model.blocks[0], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if use_policy:
        cast_like_fsdp(ref.blocks[0], policy)
        cast_like_fsdp(ref, policy, skip=(ref.blocks[0],))
    unit = model.blocks[0]._hyperfsdp_state
    buckets = [(str(b.orig_dtype), len(b.params)) for b in unit.group.buckets]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    per_step = []
    for step in range(3):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        with CollectiveCounter() as counter:
            model(local_slice(x)).pow(2).mean().backward()
        per_step.append({"ag": counter.count("ag"), "rs": counter.count("rs")})
        ref(x).pow(2).mean().backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    dtypes = {n: str(p.dtype) for n, p in model.named_parameters()}
    worst = max(
        (full(p.detach()).float() - reference_param(ref, n).detach().float()).abs().max().item()
        for n, p in model.named_parameters()
    )
    return buckets, per_step, dtypes, worst


@pytest.mark.parametrize("use_policy", [False, True])
def test_mixed_dtypes_in_one_unit(run_ranks, use_policy):
    for buckets, per_step, dtypes, worst in run_ranks(2, mixed_dtypes_in_one_unit, use_policy):
        # the unit [norm fp32, proj bf16, up bf16]: one bucket (one collective) per dtype
        assert buckets == [("torch.float32", 2), ("torch.bfloat16", 3)]
        # root unit: one bf16 bucket. blocks[0] gathers twice (forward, backward) per dtype
        assert per_step == [{"ag": 2 * 2 + 1, "rs": 2 + 1}] * 3
        assert dtypes["blocks.0.norm.weight"] == "torch.float32"
        assert dtypes["blocks.0.proj.weight"] == "torch.bfloat16"  # masters keep their dtypes
        assert worst < 3e-2


def inplace_change_does_not_reach_master():
    class SneakyLinear(nn.Linear):
        def forward(self, x):
            with torch.no_grad():
                self.weight.add_(1.0)  # modifies the unsharded bf16 compute copy
            return super().forward(x)

    class Sneaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = SneakyLinear(4, 4)

        def forward(self, x):
            return self.lin(x)

    torch.manual_seed(0)
    model = Sneaky()
    before = model.lin.weight.detach().clone()
    fully_shard(model.lin, mp_policy=POLICY)
    fully_shard(model, mp_policy=POLICY)
    for _ in range(2):
        model(torch.randn(2, 4)).float().sum()
    model.reshard()
    return (full(model.lin.weight.detach()) - before).abs().max().item()


@pytest.mark.parametrize("world", [1, 2])
def test_inplace_change_of_compute_copy_never_reaches_master(run_ranks, world):
    assert run_ranks(world, inplace_change_does_not_reach_master) == [0.0] * world


def no_all_gather_cast_path():
    model = nn.Linear(4, 3)
    fully_shard(model, mp_policy=POLICY)
    model(torch.randn(2, 4))  # the root keeps its parameters after forward
    (bucket,) = model._hyperfsdp_state.group.buckets
    hp = bucket.params[0]
    cast = bucket.payload.unsharded_flat
    return {
        "owner": str(bucket.storage_owner),
        "dtype": str(hp.unsharded_param.dtype),
        "refs_cast": hp.unsharded_param.data_ptr() == cast.data_ptr(),
        "cast_bytes": cast.untyped_storage().nbytes(),
        "gathers": model._hyperfsdp_state.ctx.comm.stats.all_gathers,
    }


def test_world_one_cast_path_uses_the_cast_result(run_ranks):
    (info,) = run_ranks(1, no_all_gather_cast_path)
    assert info == {
        "owner": "cast_buffer",
        "dtype": "torch.bfloat16",
        "refs_cast": True,
        "cast_bytes": (12 + 3) * 2,  # exactly the cast of the shard, no all-gather buffer
        "gathers": 0,
    }


def input_and_output_casts():
    seen = {}

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, extra=None, ids=None):
            seen["x"], seen["extra"], seen["ids"] = x.dtype, extra.dtype, ids.dtype
            return self.lin(x), ids

    out = {}
    for cast_inputs in (True, False):
        model = Probe()
        policy = MixedPrecisionPolicy(
            param_dtype=BF16, output_dtype=torch.float16, cast_forward_inputs=cast_inputs
        )
        fully_shard(model, mp_policy=policy)
        x = torch.randn(2, 4, dtype=BF16) if not cast_inputs else torch.randn(2, 4)
        y, ids = model(x, extra=torch.randn(2), ids=torch.arange(3))
        out[cast_inputs] = (
            str(seen["x"]),
            str(seen["extra"]),
            str(seen["ids"]),
            str(y.dtype),
            str(ids.dtype),
        )
    model = nn.Linear(4, 4)
    fully_shard(model)
    out["transforms"] = (
        model._hyperfsdp_state.input_transforms,
        model._hyperfsdp_state.output_transforms,
    )
    model(torch.randn(1, 4))
    out["transforms_after_init"] = (
        len(model._hyperfsdp_state.input_transforms),
        len(model._hyperfsdp_state.output_transforms),
    )
    return out


def test_cast_forward_inputs_and_output_dtype(run_ranks):
    (out,) = run_ranks(1, input_and_output_casts)
    # floating inputs (positional and keyword) cast to param_dtype; integer inputs untouched;
    # floating outputs cast to output_dtype
    assert out[True] == (
        "torch.bfloat16",
        "torch.bfloat16",
        "torch.int64",
        "torch.float16",
        "torch.int64",
    )
    assert out[False] == (
        "torch.bfloat16",
        "torch.float32",
        "torch.int64",
        "torch.float16",
        "torch.int64",
    )
    assert out["transforms_after_init"] == (0, 0)  # no policy: nothing runs per step


def accumulate_without_sync():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))
    ref = copy.deepcopy(model)
    cast_like_fsdp(ref, POLICY)
    fully_shard(model, mp_policy=POLICY)
    micro = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model.set_requires_gradient_sync(False)
    for x in micro[:2]:
        model(local_slice(x)).float().pow(2).mean().backward()
        ref(local_slice(x)).float().pow(2).mean().backward()  # this rank's grads, same casts
    hp = model._hyperfsdp_state.group.params[0]
    acc = hp.accumulated_grad
    info = {"dtype": str(acc.dtype), "sharded_grad": model[0].weight.grad is None}
    ref_local = reference_param(ref, "0.weight").grad
    info["acc_matches"] = torch.equal(acc, ref_local)
    # final micro-batch synchronises: the sum over micro-batches and ranks is reduced once
    model.set_requires_gradient_sync(True)
    model(local_slice(micro[2])).float().pow(2).mean().backward()
    return info


def test_accumulation_without_sync_is_in_reduce_dtype(run_ranks):
    for info in run_ranks(2, accumulate_without_sync):
        assert info == {"dtype": "torch.float32", "sharded_grad": True, "acc_matches": True}
