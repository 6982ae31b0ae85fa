"""Hook state machine: RFC 3.3-3.5 transition sequences, checkpointing parity, recovery."""

import functools
import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing.reference import Transformer, lm_loss, token_batch, train_parity


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Wrapper(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(4, 1)
        self.mode = mode

    def forward(self, x):
        if self.mode == "plain":
            h = self.block(x)
        else:
            h = checkpoint(self.block, x, use_reentrant=self.mode == "reentrant")
        return self.head(h)


def block_transitions(mode, input_requires_grad):
    os.environ["HYPERFSDP_LOG_TRANSITIONS"] = "1"
    model = Wrapper(mode)
    fully_shard(model.block)
    fully_shard(model)
    x = torch.randn(2, 4, requires_grad=input_requires_grad)
    for _ in range(2):  # the second iteration starts from IDLE again
        model(x).sum().backward()
    log = model._hyperfsdp_state.ctx.transition_log
    return [(event, old, new) for fqn, event, old, new in log if fqn == "block"]


NORMAL = [  # RFC 3.3: inputs need no grad, so the root callback runs post_backward
    ("forward_pre", "IDLE", "PRE_FORWARD"),
    ("forward_post", "PRE_FORWARD", "FORWARD"),
    ("backward_pre", "FORWARD", "PRE_BACKWARD"),
    ("root_backward_enter", "PRE_BACKWARD", "PRE_BACKWARD"),
    ("post_backward", "PRE_BACKWARD", "BACKWARD"),
    ("root_backward_exit", "BACKWARD", "BACKWARD"),
]
NORMAL_GRAD_INPUT = [  # post-backward autograd function first; the root still drains
    ("forward_pre", "IDLE", "PRE_FORWARD"),
    ("forward_post", "PRE_FORWARD", "FORWARD"),
    ("backward_pre", "FORWARD", "PRE_BACKWARD"),
    ("post_backward", "PRE_BACKWARD", "BACKWARD"),
    ("root_backward_enter", "BACKWARD", "BACKWARD"),
    ("root_backward_exit", "BACKWARD", "BACKWARD"),
]
NON_REENTRANT = [  # RFC 3.4: recomputed forward_pre is idempotent, forward_post may not run
    ("forward_pre", "IDLE", "PRE_FORWARD"),
    ("forward_post", "PRE_FORWARD", "FORWARD"),
    ("backward_pre", "FORWARD", "PRE_BACKWARD"),
    ("forward_pre", "PRE_BACKWARD", "PRE_BACKWARD"),
    ("root_backward_enter", "PRE_BACKWARD", "PRE_BACKWARD"),
    ("post_backward", "PRE_BACKWARD", "BACKWARD"),
    ("root_backward_exit", "BACKWARD", "BACKWARD"),
]
REENTRANT = [  # RFC 3.5: a second forward pair runs inside backward
    ("forward_pre", "IDLE", "PRE_FORWARD"),
    ("forward_post", "PRE_FORWARD", "FORWARD"),
    ("forward_pre", "FORWARD", "PRE_FORWARD"),
    ("forward_post", "PRE_FORWARD", "FORWARD"),
    ("backward_pre", "FORWARD", "PRE_BACKWARD"),
    ("post_backward", "PRE_BACKWARD", "BACKWARD"),
    ("root_backward_enter", "BACKWARD", "BACKWARD"),
    ("root_backward_exit", "BACKWARD", "BACKWARD"),
]


@pytest.mark.parametrize(
    ("mode", "grad_input", "expected"),
    [
        ("plain", False, NORMAL),
        ("plain", True, NORMAL_GRAD_INPUT),
        ("non_reentrant", False, NON_REENTRANT),
        ("reentrant", True, REENTRANT),
    ],
)
def test_transition_sequences(run_ranks, mode, grad_input, expected):
    for log in run_ranks(2, block_transitions, mode, grad_input):
        assert log == expected * 2


class CheckpointedTransformer(Transformer):
    def __init__(self, mode, **kw):
        super().__init__(**kw)
        self.mode = mode

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=self.mode == "reentrant")
        return self.output(self.norm(h))


def checkpoint_parity(mode, reshard_after_forward):
    def shard(model):
        for block in model.layers:
            fully_shard(block, reshard_after_forward=reshard_after_forward)
        fully_shard(model)

    build = functools.partial(
        CheckpointedTransformer, mode, vocab=29, dim=16, n_layers=3, hidden=20
    )
    train_parity(build, shard, lambda s: token_batch(s, 4, 5, 29), lm_loss, steps=3)
    return True


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_activation_checkpointing_parity(run_ranks, mode, reshard_after_forward):
    run_ranks(2, checkpoint_parity, mode, reshard_after_forward)


def bucket_lifecycle():
    """A bucket's state through unshard, reshard_after_forward=<int> and reshard; a pair the
    table does not list raises, naming the unit and the state."""
    from hyperfsdp_core.engine.lifecycle import BUCKET_TRANSITIONS, BucketState

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    fully_shard(model[0])
    fully_shard(model)
    bucket = model[0]._hyperfsdp_state.group.buckets[0]
    seen = [bucket.state]
    handle = model[0].unshard(async_op=True)
    seen.append(bucket.state)  # the all-gather is in flight
    handle.wait()
    seen.append(bucket.state)
    model[0].reshard()
    seen.append(bucket.state)
    model[0].unshard(async_op=True)  # a prefetch nobody waits for: reshard abandons it
    model[0].reshard()
    seen.append(bucket.state)
    try:
        bucket._move("gathered")
        error = None
    except RuntimeError as exc:
        error = str(exc)
    every_state_reshards = all(
        BUCKET_TRANSITIONS["reshard"][s] is BucketState.SHARDED for s in BucketState
    )
    return [str(s) for s in seen], error, every_state_reshards


def test_bucket_lifecycle_follows_its_table(run_ranks):
    for seen, error, every_state_reshards in run_ranks(2, bucket_lifecycle):
        assert seen == ["sharded", "gathering", "unsharded", "sharded", "sharded"]
        assert error is not None and "got 'gathered' in state sharded" in error
        assert every_state_reshards


def post_forward_lifecycle():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    fully_shard(model[0], reshard_after_forward=2)
    fully_shard(model)
    bucket = model[0]._hyperfsdp_state.group.buckets[0]
    seen = []
    model[1].register_forward_pre_hook(lambda *_: seen.append(str(bucket.state)))
    model(torch.randn(2, 8)).sum().backward()
    seen.append(str(bucket.state))
    return seen


def test_post_forward_state_between_forward_and_backward(run_ranks):
    # world 4, the smaller group of 2: held over it between forward and backward
    for seen in run_ranks(4, post_forward_lifecycle):
        assert seen == ["post_forward", "sharded"]
