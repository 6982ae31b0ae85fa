"""Per-root contexts (two models interleaved) and recovery with reset_iter_state()."""

import copy

import pytest
import torch
from torch import nn

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing.reference import (
    MLPStack,
    Transformer,
    assert_close_params,
    lm_loss,
    local_slice,
    mlp_batch,
    mse_loss,
    token_batch,
)


def shard_layers(model):
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)


def two_models_interleaved():
    torch.manual_seed(0)
    a = Transformer(vocab=29, dim=8, n_layers=2, hidden=12)
    b = MLPStack([6, 10, 3])
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    shard_layers(a)
    shard_layers(b)
    assert a._hyperfsdp_state.ctx is None and b._hyperfsdp_state.ctx is None
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b, ref_a, ref_b)]
    for step in range(3):
        xa, ya = token_batch(step, 4, 5, 29)
        xb, yb = mlp_batch(step, 4, 6)
        # interleave: forward a, forward b, backward b, backward a
        la = lm_loss(a(local_slice(xa)), local_slice(ya))
        lb = mse_loss(b(local_slice(xb)), local_slice(yb))
        lb.backward()
        la.backward()
        lm_loss(ref_a(xa), ya).backward()
        mse_loss(ref_b(xb), yb).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert a._hyperfsdp_state.ctx is not b._hyperfsdp_state.ctx
    assert_close_params(a, ref_a)
    assert_close_params(b, ref_b)
    return True


def test_two_models_interleaved(run_ranks):
    assert run_ranks(2, two_models_interleaved) == [True, True]


class Boom(Exception):
    pass


class Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = MLPStack([6, 9, 7, 3])
        self.fail_forward = False
        self.fail_backward = False

    def forward(self, x):
        h = self.body.layers[0](x)
        if self.fail_forward:
            raise Boom("forward")
        if self.fail_backward:
            h = h + 0  # a node whose backward raises

            def explode(grad):
                raise Boom("backward")

            h.register_hook(explode)
        for layer in self.body.layers[1:]:
            h = layer(torch.relu(h))
        return h


def recover(where):
    torch.manual_seed(0)
    model = Fragile()
    ref = copy.deepcopy(model)
    for layer in model.body.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    failed = 0
    for step in range(4):
        x, y = mlp_batch(step, 4, 6)
        if step == 1:
            setattr(model, f"fail_{where}", True)
            try:
                mse_loss(model(local_slice(x)), local_slice(y)).backward()
            except Boom:
                failed += 1
            setattr(model, f"fail_{where}", False)
            model.reset_iter_state()
            opt.zero_grad()
            continue  # the reference skips the failed step
        mse_loss(model(local_slice(x)), local_slice(y)).backward()
        mse_loss(ref(x), y).backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert failed == 1
    assert_close_params(model, ref)
    return True


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_reset_iter_state_after_exception(run_ranks, where):
    assert run_ranks(2, recover, where, timeout=120) == [True, True]


def reset_on_non_root():
    model = MLPStack([4, 4, 4])
    shard_layers(model)
    model(torch.randn(2, 4)).sum().backward()
    try:
        model.layers[0].reset_iter_state()
    except RuntimeError as exc:
        return "root" in str(exc)
    return False


def test_reset_iter_state_needs_the_root(run_ranks):
    assert run_ranks(1, reset_on_non_root) == [True]
