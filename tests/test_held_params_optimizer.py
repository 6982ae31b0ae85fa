"""Unsharded parameters held across an optimizer step are never used stale (issue 28, item 1).

A unit keeps its unsharded parameters past its hooks after an evaluation forward (the
root; ``reshard_after_forward=False`` units), after a backward with
``set_reshard_after_backward(False)``, and after an explicit ``unshard()``. An optimizer
step between that and the next forward must not leave the next forward computing with
the pre-step weights, nor ``model.parameters()`` showing them, whichever optimizer
kernel writes the step: for-loop, ``foreach``, ``fused`` (the GPU defaults), or a user's
own optimizer writing with ``torch._foreach_*`` or ``p.data.copy_()``.

Each case trains a sharded model and an unsharded reference on the same global batch,
with an evaluation forward between every backward and optimizer step, and compares the
losses at every step, the registered parameters after the last step, and a training
forward after it.
"""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing.reference import full, local_slice

ATOL, RTOL = 1e-5, 1e-4
MODES = ("no_grad", "inference_mode", "eval")
HOLDS = ("root", "reshard_after_forward_false", "reshard_after_backward_false")
# fused SGD: DTensor has no sharding strategy for aten._fused_sgd_ in torch 2.13, so no
# DTensor-parameter FSDP (FSDP2 neither) can step it
OPTIMIZERS = (
    ("SGD", "for-loop"),
    ("SGD", "foreach"),
    ("AdamW", "for-loop"),
    ("AdamW", "foreach"),
    ("AdamW", "fused"),
)


class Net(nn.Module):
    """Parameters in the root unit (``inp``, ``head``, uneven on dim 0) and three blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


class ForeachSGD(torch.optim.Optimizer):
    """A user's optimizer that writes the parameters with a foreach kernel."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            torch._foreach_add_(params, [p.grad for p in params], alpha=-group["lr"])


class DataCopySGD(torch.optim.Optimizer):
    """A user's optimizer that writes through ``.data`` (no autograd version bump)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.copy_(p.data - group["lr"] * p.grad.data)


def make_optimizer(params, kind, impl):
    if kind == "ForeachSGD":
        return ForeachSGD(params, lr=0.1)
    if kind == "DataCopySGD":
        return DataCopySGD(params, lr=0.1)
    flags = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    if kind == "SGD":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, **flags[impl])
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01, **flags[impl])


def batch(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 5, generator=g)


def loss_fn(out, y):
    return (out - y).pow(2).mean()


def close(a, b):
    return abs(a - b) <= ATOL * 10 + RTOL * 10 * abs(b)


def global_loss(loss):
    avg = loss.detach().clone()
    dist.all_reduce(avg)
    return avg.item() / dist.get_world_size()


def evaluate(model, ref, mode, step):
    x, y = batch(100 + step)
    if mode == "eval":  # module eval(), grad enabled, no backward follows
        model.eval(), ref.eval()
        out, ref_out = model(local_slice(x)), ref(x)
        model.train(), ref.train()
    else:
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
            out, ref_out = model(local_slice(x)), ref(x)
    return global_loss(loss_fn(out, local_slice(y))), loss_fn(ref_out, y).item()


def train_backward(model, ref, step):
    """Forward and backward of both models on ``step``'s batch; a loss mismatch, if any."""
    x, y = batch(step)
    loss = loss_fn(model(local_slice(x)), local_slice(y))
    loss.backward()
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    if not close(global_loss(loss), ref_loss.item()):
        return [f"step {step}: loss {global_loss(loss)} != {ref_loss.item()}"]
    return []


def run_case(hold, mode, kind, impl, steps=3):
    """Train with an evaluation forward between each backward and step; the mismatches."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=hold != "reshard_after_forward_false")
    fully_shard(model)
    if hold == "reshard_after_backward_false":
        model.set_reshard_after_backward(False)
    opt, ref_opt = (
        make_optimizer(model.parameters(), kind, impl),
        make_optimizer(ref.parameters(), kind, impl),
    )
    bad = []
    for step in range(steps):
        bad += train_backward(model, ref, step)
        got, want = evaluate(model, ref, mode, step)
        if not close(got, want):
            bad.append(f"step {step}: evaluation loss {got} != {want}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    # what model.parameters() shows right after the last step (an EMA, an export, a log)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if not torch.allclose(full(p.detach()), ref_params[name].detach(), atol=ATOL, rtol=RTOL):
            bad.append(f"{name} after the last step differs from the reference")
    x, y = batch(50)  # and the next training forward computes with the new weights
    got, want = global_loss(loss_fn(model(local_slice(x)), local_slice(y))), loss_fn(ref(x), y)
    if not close(got, want.item()):
        bad.append(f"forward after the last step: loss {got} != {want.item()}")
    return [f"{hold}/{mode}/{kind}-{impl}: {b}" for b in bad]


def run_matrix(cases):
    failures = []
    for case in cases:
        failures += run_case(*case)
    return failures


FULL = [(h, m, k, i) for h, m, (k, i) in itertools.product(HOLDS, MODES, OPTIMIZERS)]
USERS = [(h, "no_grad", k, "") for h in HOLDS for k in ("ForeachSGD", "DataCopySGD")]


def test_full_matrix_world_2(run_ranks):
    failures = run_ranks(2, run_matrix, FULL, timeout=300)
    assert failures[0] == [], "\n".join(failures[0])


def test_users_own_optimizers(run_ranks):
    failures = run_ranks(2, run_matrix, USERS, timeout=120)
    assert failures[0] == [], "\n".join(failures[0])


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_world_4(run_ranks, impl):
    cases = [(h, m, "AdamW", impl) for h in HOLDS for m in MODES]
    failures = run_ranks(4, run_matrix, cases, timeout=300)
    assert failures[0] == [], "\n".join(failures[0])


def unshard_then_step(kind, impl):
    """An explicit ``unshard()`` held across a step: the next forward uses the new weights."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt, ref_opt = (
        make_optimizer(model.parameters(), kind, impl),
        make_optimizer(ref.parameters(), kind, impl),
    )
    bad = []
    for step in range(3):
        for block in model.blocks:
            block.unshard()
        bad += train_backward(model, ref, step)
        model.blocks[0].unshard()  # held across the step
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        w = full(model.blocks[0].weight.detach())
        if not torch.allclose(w, ref.blocks[0].weight.detach(), atol=ATOL, rtol=RTOL):
            bad.append(f"step {step}: blocks.0.weight after step differs")
    return bad


@pytest.mark.parametrize("world", [2, 4])
def test_explicit_unshard_across_step(run_ranks, world):
    for res in run_ranks(world, unshard_then_step, "AdamW", "fused", timeout=120):
        assert res == [], "\n".join(res)
