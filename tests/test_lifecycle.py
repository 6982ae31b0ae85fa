"""Lifetimes of what the core creates: process-group caches, communication contexts.

The core (separate reduce-scatter groups, 1-D mesh infos) and the hsdp plugin (HSDP and
DDP mesh infos, flattened groups) cache objects made from process groups. After a
re-initialization those groups are dead; the caches must hand out new ones. A unit
``unshard()``-ed before the root's first forward gets a provisional communication
context, which the root replaces (and empties) at its lazy init.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from hyperfsdp_core import fully_shard
from hyperfsdp_core.testing import run_on_ranks
from hyperfsdp_core.testing.pool import DEFAULT_TIMEOUT


def train_once(kind: str) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    ref = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    ref.load_state_dict(model.state_dict())
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model[0], mesh=mesh, replicate_params={model[0].bias})
        fully_shard(model, mesh=mesh)
    else:
        mesh = init_device_mesh("cpu", (2,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_separate_reduce_scatter_group(True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).sum().backward()
    everyone = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(everyone, x)
    ref(torch.cat(everyone)).sum().div(2).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=n)
    return float(sum(p.grad.full_tensor().abs().sum() for p in model.parameters()))


def rank_reinit(store_dir: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    sums = []
    for generation in range(3):
        for kind in ("fsdp", "hsdp"):
            sums.append(train_once(kind))
        dist.destroy_process_group()
        store = dist.FileStore(os.path.join(store_dir, f"store{generation}"), world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world,
            timeout=timedelta(seconds=DEFAULT_TIMEOUT),
        )  # fmt: skip
    return sums


def test_training_after_process_group_reinit(tmp_path):
    sums = run_on_ranks(2, rank_reinit, str(tmp_path), timeout=180)
    assert sums[0] == sums[1]
    assert sums[0][0:2] == sums[0][2:4] == sums[0][4:6]  # the same run, every generation


def rank_unshard_before_first_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    fully_shard(model[0])
    fully_shard(model)
    # before lazy init no transport is asked: torch's own all-gather into a pooled
    # staging buffer, so the early comm then holds a buffer
    model[0].unshard()  # before any forward: no root, no shared context yet
    early = model[0]._hyperfsdp_state.comm
    pooled_before = early.pooled_bytes
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
    ctx = model._hyperfsdp_state.ctx
    states = [m._hyperfsdp_state for m in (model, model[0])]
    return {
        "early_was_provisional": early.provisional,
        "all_share_ctx_comm": all(s.comm is ctx.comm for s in states),
        "early_replaced": early is not ctx.comm,
        "early_trimmed": early.pooled_bytes == 0,
        "pooled_before_forward": pooled_before > 0,
    }


def test_unshard_before_first_forward_joins_the_roots_context():
    for out in run_on_ranks(2, rank_unshard_before_first_forward, timeout=120):
        assert out == {
            "early_was_provisional": True,
            "all_share_ctx_comm": True,
            "early_replaced": True,
            "early_trimmed": True,
            "pooled_before_forward": True,
        }
