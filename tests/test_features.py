"""fully_shard options and behaviours: ignored params, Shard(k), list units, divide factor,
forward prefetch under changing control flow, transition logging, the demo command."""

import logging
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing import shared_memory
from hyperfsdp_core.testing.reference import (
    MLPStack,
    assert_close_params,
    full,
    mlp_batch,
    mse_loss,
    train_parity,
)


def ignored_params():
    torch.manual_seed(0)
    model = MLPStack([4, 6, 3])
    frozen = model.layers[1].bias
    fully_shard(model, ignored_params={frozen})
    assert model.layers[1].bias is frozen and not isinstance(frozen, DTensor)
    assert isinstance(model.layers[1].weight, DTensor)
    model(torch.randn(2, 4)).sum().backward()
    # ignored: not sharded and not reduced (its gradient is this rank's local one)
    return [row.fqn for row in model.sharding_plan()], frozen.grad is not None


def test_ignored_params(run_ranks):
    for fqns, has_grad in run_ranks(2, ignored_params):
        assert fqns == ["layers.0.weight", "layers.0.bias", "layers.1.weight"]
        assert has_grad


def shard_dim_one():
    def shard(model):
        fully_shard(model.layers[0], shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
        fully_shard(model)

    train_parity(
        lambda: MLPStack([8, 6, 3]), shard, lambda s: mlp_batch(s, 4, 8), mse_loss, steps=3
    )
    torch.manual_seed(0)
    model = MLPStack([8, 6, 3])
    shard(model)
    w = model.layers[0].weight
    return tuple(w.placements), tuple(w.to_local().shape)


def test_shard_placement_fn_nonzero_dim(run_ranks):
    for placements, local in run_ranks(2, shard_dim_one):
        assert placements == (Shard(1),) and local == (6, 4)


def list_unit():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(5, 7)
            self.b = nn.Linear(7, 3)
            self.c = nn.Linear(3, 2)

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

    def shard(m):
        fully_shard([m.a, m.b])  # one communication group for two sibling modules
        fully_shard(m)

    train_parity(Model, shard, lambda s: mlp_batch(s, 4, 5), mse_loss, steps=3)
    torch.manual_seed(0)
    m = Model()
    shard(m)
    assert m.a._hyperfsdp_state is m.b._hyperfsdp_state
    return len(m.a._hyperfsdp_state.group.buckets)


def test_list_unit_is_one_group(run_ranks):
    assert run_ranks(2, list_unit) == [1, 1]


def divide_factor(factor, deprecated_name=False):
    torch.manual_seed(0)
    model = MLPStack([4, 6, 3])
    ref = MLPStack([4, 6, 3])
    ref.load_state_dict({k: v for k, v in model.state_dict().items()})
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    for m in [model, *model.layers]:
        if deprecated_name:
            m.set_reduce_scatter_divide_factor(factor)  # FSDP2's older spelling
        else:
            m.set_gradient_divide_factor(factor)
    x, _ = mlp_batch(0, 4, 4)
    mse_loss(model(x.chunk(2)[dist.get_rank()]), None).backward()
    mse_loss(ref(x), None).backward()
    world = dist.get_world_size()
    ref_grads = dict((n, p.grad) for n, p in ref.named_parameters())
    # gradients are summed over ranks and divided by `factor` (the default divides by world)
    return max(
        (full(p.grad) - ref_grads[n] * world / factor).abs().max().item()
        for n, p in model.named_parameters()
    )


def test_gradient_divide_factor_sum_on_gloo(run_ranks):
    for diff in run_ranks(2, divide_factor, 1.0):  # gloo has no pre-multiplied sum: scaled SUM
        assert diff < 1e-6
    for diff in run_ranks(2, divide_factor, 4.0):
        assert diff < 1e-6
    for diff in run_ranks(2, divide_factor, 3.0, True):
        assert diff < 1e-6


class Router(nn.Module):
    """Runs a different subset of blocks each step: forward prefetch must not leak or break."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.step = 0

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if (i + self.step) % 3 != 0:
                x = torch.tanh(block(x))
        return x


def changing_control_flow():
    torch.manual_seed(0)
    model = Router()
    ref = Router()
    ref.load_state_dict(model.state_dict())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    from hyperfsdp_core.testing.reference import local_slice

    for step in range(6):
        model.step = ref.step = step
        x, _ = mlp_batch(step, 4, 6)
        mse_loss(model(local_slice(x)), None).backward()
        mse_loss(ref(x), None).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        states = [b._hyperfsdp_state for b in model.blocks]
        # nothing prefetched is left gathered or in flight after the step
        assert all(s.group.is_sharded for s in states), step
    assert_close_params(model, ref)
    ctx = model._hyperfsdp_state.ctx
    return len(ctx.next_in_forward)


def test_forward_prefetch_with_changing_control_flow(run_ranks):
    assert all(n > 0 for n in run_ranks(2, changing_control_flow))


def transition_logging():
    os.environ["HYPERFSDP_LOG_TRANSITIONS"] = "1"
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("hyperfsdp_core.transitions")
    handler = Keep()
    logger.addHandler(handler)
    try:
        model = MLPStack([3, 4, 2])
        fully_shard(model.layers[0])
        fully_shard(model)
        model(torch.randn(2, 3)).sum().backward()
    finally:
        logger.removeHandler(handler)
    return records


def test_transition_log_env_var(run_ranks):
    (records,) = run_ranks(1, transition_logging)
    assert "layers.0 forward_pre: IDLE -> PRE_FORWARD" in records
    assert "<root> root_backward_exit: BACKWARD -> BACKWARD" in records


def test_demo_command():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hyperfsdp_core",
            "demo",
            "--world-size",
            "2",
            "--steps",
            "6",
            "--layers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "parity with the single-process reference: OK" in out.stdout
    assert "sharding plan (rank 0):" in out.stdout and "tok_embeddings.weight" in out.stdout


def prefetch_observed(shm):
    with shared_memory(shm):
        return _prefetch_observed()


def _prefetch_observed():
    torch.manual_seed(0)
    model = MLPStack([6, 6, 6, 6, 6])
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    seen = []
    for i, layer in enumerate(model.layers):
        bucket = layer._hyperfsdp_state.group.buckets[0]
        # runs before hyperfsdp's own pre-hook: is this unit's all-gather already issued?
        layer.register_forward_pre_hook(
            lambda mod, args, i=i, b=bucket: seen.append(
                (i, b.pending is not None or b.is_unsharded)
            ),
            prepend=True,
        )
    for _ in range(2):
        seen.clear()
        model(torch.randn(2, 6)).sum().backward()
    return seen


def test_next_units_all_gather_is_issued_before_its_forward(run_ranks):
    (seen, _) = run_ranks(2, prefetch_observed, False)
    # second iteration: layer 0 is prefetched by the root, layers 1.. by their predecessor
    assert seen == [(0, True), (1, True), (2, True), (3, True)]


def test_gathers_in_line_are_not_prefetched(run_ranks):
    # through shared memory an all-gather completes when issued: issuing it a unit early
    # would overlap nothing, so each unit gathers in its own pre-forward
    (seen, _) = run_ranks(2, prefetch_observed, True)
    assert seen == [(0, False), (1, False), (2, False), (3, False)]


def backward_prefetch_order(shm):
    """In backward the root prefetches the last block once its first gradient is
    accumulated (past the loss/head activation peak), before that block's backward
    (gathers through gloo; through shared memory each block gathers in its own
    pre-backward)."""
    with shared_memory(shm):
        return _backward_prefetch_order()


def _backward_prefetch_order():
    from hyperfsdp_core.engine.unit_params import Bucket
    from hyperfsdp_core.testing.reference import Transformer

    os.environ["HYPERFSDP_LOG_TRANSITIONS"] = "1"
    torch.manual_seed(0)
    model = Transformer(vocab=31, dim=8, n_layers=2, hidden=12)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    tokens = torch.randint(0, 31, (2, 5))
    model(tokens).sum().backward()  # lazy init, forward order known
    ctx = model._hyperfsdp_state.ctx
    log = ctx.transition_log
    log.clear()
    names = {id(b): s.fqn for s in ctx.states if s.group for b in s.group.buckets}
    orig = Bucket.start_unshard

    def start_unshard(self, comm):
        if self.pending is None and not self.is_unsharded:
            log.append((names[id(self)], "gather_issued", "", ""))
        return orig(self, comm)

    Bucket.start_unshard = start_unshard
    try:
        loss = model(tokens).sum()
        log.clear()
        loss.backward()
    finally:
        Bucket.start_unshard = orig
    return [(fqn, event) for fqn, event, *_ in log if event in ("gather_issued", "backward_pre")]


def test_backward_prefetch_from_the_root_is_deferred_past_its_first_gradient(run_ranks):
    events = run_ranks(2, backward_prefetch_order, False)[0]
    # the root's own backward starts first; layers.1's gather is issued before its backward
    assert events[0] == ("", "backward_pre")
    assert events.index(("layers.1", "gather_issued")) < events.index(("layers.1", "backward_pre"))
    assert events.index(("layers.0", "gather_issued")) < events.index(("layers.0", "backward_pre"))


def test_backward_gathers_in_line_in_each_units_pre_backward(run_ranks):
    events = run_ranks(2, backward_prefetch_order, True)[0]
    assert events == [
        ("", "backward_pre"),
        ("layers.1", "backward_pre"),
        ("layers.1", "gather_issued"),
        ("layers.0", "backward_pre"),
        ("layers.0", "gather_issued"),
    ]
