"""Collective counts per step, counted at torch.distributed itself."""

import pytest
import torch

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing.counting import CollectiveCounter
from hyperfsdp_core.testing.reference import Transformer, lm_loss, local_slice, token_batch

KINDS = (("all_gather", "ag"), ("reduce_scatter", "rs"), ("all_reduce", "ar"))


def counts_per_step(reshard_after_forward, n_layers=3):
    torch.manual_seed(0)
    model = Transformer(vocab=31, dim=8, n_layers=n_layers, hidden=12)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for step in range(3):
        x, y = token_batch(step, 4, 5, 31)
        with CollectiveCounter() as counter:
            lm_loss(model(local_slice(x)), local_slice(y)).backward()
        opt.step()
        opt.zero_grad()
        results.append({kind: counter.count(short) for kind, short in KINDS})
    stats = model._hyperfsdp_state.ctx.comm.stats.snapshot()
    return results, stats


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_collectives_per_step(run_ranks, reshard_after_forward):
    n_layers = 3
    per_rank = run_ranks(2, counts_per_step, reshard_after_forward, n_layers)
    # non-root units gather in forward and (after resharding) again in backward; the
    # root keeps its parameters after forward and gathers once; every unit
    # reduce-scatters once; nothing is all-reduced in pure FSDP
    gathers = n_layers * (2 if reshard_after_forward else 1) + 1
    expected = {"all_gather": gathers, "reduce_scatter": n_layers + 1, "all_reduce": 0}
    for steps, stats in per_rank:
        assert steps == [expected] * 3
        assert stats["all_gathers"] == 3 * gathers
        assert stats["reduce_scatters"] == 3 * (n_layers + 1)


def saved_by_no_reshard():
    a = counts_per_step(True, 2)[0][0]["all_gather"]
    b = counts_per_step(False, 2)[0][0]["all_gather"]
    return a - b


def test_reshard_after_forward_false_saves_backward_gathers(run_ranks):
    assert run_ranks(2, saved_by_no_reshard) == [2, 2]


def world_one_issues_nothing():
    per_step, _ = counts_per_step(True, 2)
    return per_step[0]


def test_world_one_has_no_collectives(run_ranks):
    # shard size 1: parameters alias their storage, gradients are local
    assert run_ranks(1, world_one_issues_nothing) == [
        {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    ]
