"""Training parity against a single-process reference on the global batch (fp32)."""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hyperfsdp_core import FSDPModule, fully_shard
from hyperfsdp_core.testing.reference import (
    MLPStack,
    Transformer,
    lm_loss,
    mlp_batch,
    mse_loss,
    token_batch,
    train_parity,
)


def shard_mlp(model, reshard_after_forward):
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model)


def shard_transformer(model, reshard_after_forward=True):
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model)


def mlp_parity(reshard_after_forward):
    dims = [8, 16, 5, 9, 3]
    result = train_parity(
        lambda: MLPStack(dims),
        functools.partial(shard_mlp, reshard_after_forward=reshard_after_forward),
        lambda step: mlp_batch(step, 8, dims[0]),
        mse_loss,
        steps=4,
    )
    return result["losses"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_mlp_stack_parity(run_ranks, world, reshard_after_forward):
    losses = run_ranks(world, mlp_parity, reshard_after_forward)
    assert all(rank_losses == losses[0] for rank_losses in losses)  # every rank saw the same loss
    assert losses[0][-1] < losses[0][0]  # and it trained


def transformer_parity(reshard_after_forward, tied):
    result = train_parity(
        lambda: Transformer(vocab=37, dim=16, n_layers=3, n_heads=2, hidden=27, tied=tied),
        functools.partial(shard_transformer, reshard_after_forward=reshard_after_forward),
        lambda step: token_batch(step, 4, 6, 37),
        lm_loss,
        steps=4,
        clip=1.0,
    )
    norms = result["norms"]
    for norm, ref_norm in norms:
        assert abs(norm - ref_norm) <= 1e-5 * max(1.0, ref_norm), (norm, ref_norm)
    return result["losses"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_transformer_parity(run_ranks, world, reshard_after_forward):
    losses = run_ranks(world, transformer_parity, reshard_after_forward, False)
    assert all(rank_losses == losses[0] for rank_losses in losses)


def test_tied_embedding_in_root_unit(run_ranks):
    run_ranks(2, transformer_parity, True, True)


def check_dtensor_params_and_grads():
    torch.manual_seed(0)
    model = MLPStack([5, 4, 3])
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    shard_mlp(model, True)
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    assert isinstance(model, FSDPModule) and type(model).__name__ == "FSDPMLPStack"
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p, nn.Parameter), name
        assert p.placements == (Shard(0),), name
    w = model.layers[0].weight
    assert w.shape == (4, 5)  # logical global shape, never padded
    model(torch.randn(2, 5)).sum().backward()
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), name
        assert p.grad.placements == p.placements and p.grad.shape == p.shape, name
        assert p.grad.to_local().shape == p.to_local().shape, name
    return True


def test_params_and_grads_are_dtensors(run_ranks):
    assert run_ranks(2, check_dtensor_params_and_grads) == [True, True]


def inputs_without_grad_and_multiple_outputs():
    """Units whose inputs need no grad, units with two outputs, a unit not run."""

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 5)
            self.b = nn.Linear(6, 3)

        def forward(self, x):
            return self.a(x), self.b(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 6)
            self.heads = TwoHeads()
            self.unused = nn.Linear(6, 6)

        def forward(self, x):
            a, b = self.heads(self.inp(x))
            return a.sum(-1) + b.pow(2).sum(-1)

    def shard(m):
        fully_shard(m.inp)
        fully_shard(m.heads)
        fully_shard(m.unused)
        fully_shard(m)

    train_parity(
        Model,
        shard,
        lambda s: (torch.randn(8, 4, generator=torch.Generator().manual_seed(s)),) * 2,
        lambda out, _: out.mean(),
        steps=3,
    )
    return True


def test_unit_inputs_without_grad_multiple_outputs_and_unused_unit(run_ranks):
    run_ranks(2, inputs_without_grad_and_multiple_outputs)
