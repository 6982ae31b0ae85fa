"""A torch dispatch mode entered on one rank only (``FlopCounterMode``, ``CommDebugMode``, a
mode of the user's own around one rank's step: how a trainer measures FLOPs or counts
collectives on rank 0) changes nothing about the collectives: training goes on with the
unsharded reference's losses on every CPU transport (the ``hyperfsdp-shm`` plugin's shared
memory, the core's gloo routes, gloo's own), and the mode sees what it sees
under FSDP2 (the same collectives, the same FLOPs).

The sharded model uses a group with a short timeout: a collective whose route differed
between ranks fails the test within seconds instead of hanging it.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from contextlib import nullcontext
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hyperfsdp_core.testing.reference import Transformer, lm_loss, local_slice, token_batch

STEPS = 3
VOCAB = 33
#: seconds a collective of the sharded model waits for its peers
GROUP_TIMEOUT = 10

#: settings of the hyperfsdp-shm plugin and the core's gloo routes (what their environment
#: variables set at lazy init); "gloo_routes": the core's, at every size; "no_plugin"
#: disables the plugin itself (``HYPERFSDP_PLUGINS_DISABLE=shm``: the core's defaults)
TRANSPORTS = {
    "shm": {"SHM": True, "NATIVE": False, "ALL_GATHER_MIN_BYTES": 0},
    "gloo_routes": {"SHM": False, "NATIVE": False, "ALL_GATHER_MIN_BYTES": 0},
    "no_plugin": {},
}


def _owner(name: str):
    """The module that holds switch ``name``: the plugin's ``SHM``, else the core's gloo
    routes' (``NATIVE``, ``ALL_GATHER_MIN_BYTES``)."""
    if name == "SHM":
        from hyperfsdp_shm import _settings

        return _settings
    from hyperfsdp_core.comm import gloo

    return gloo


class CollectivesSeen(TorchDispatchMode):
    """A mode of the user's own: passes every op through and counts the c10d ones."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func._overloadpacket)
        if name.startswith(("c10d.", "_c10d_functional.")):
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


def _mode(name: str):
    if name == "flop_counter":
        from torch.utils.flop_counter import FlopCounterMode

        return FlopCounterMode(display=False)
    if name == "comm_debug":
        from torch.distributed.tensor.debug import CommDebugMode

        return CommDebugMode()
    return CollectivesSeen()


def _seen(name: str, mode) -> dict:
    """What ``mode`` observed, comparable between implementations."""
    if name == "flop_counter":
        return {"flops": mode.get_total_flops()}
    if name == "comm_debug":
        return {str(op): n for op, n in mode.get_comm_counts().items()}
    return dict(mode.seen)


def _step(model, opt, step: int) -> torch.Tensor:
    x, y = token_batch(step, 8, 5, VOCAB)
    loss = lm_loss(model(local_slice(x)), local_slice(y))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def train_with_mode_on_one_rank(impl: str, transport: str, mode_name: str, mode_rank: int, at: int):
    """Train ``STEPS`` steps, step ``at`` inside ``mode_name`` on rank ``mode_rank`` only;
    check every rank's losses against the unsharded reference; return what the mode saw
    (on ``mode_rank``; ``None`` elsewhere)."""
    from torch.distributed.device_mesh import DeviceMesh

    if impl == "hyperfsdp":
        from hyperfsdp_core import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    settings = TRANSPORTS[transport]
    if settings:
        saved = {name: getattr(_owner(name), name) for name in settings}
        for name, value in settings.items():
            setattr(_owner(name), name, value)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        group = dist.new_group(list(range(world)), timeout=timedelta(seconds=GROUP_TIMEOUT))
        mesh = DeviceMesh.from_group(group, "cpu")
        torch.manual_seed(0)
        model = Transformer(vocab=VOCAB, dim=16, n_layers=3, hidden=24)
        ref = copy.deepcopy(model)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, seen = [], None
        for step in range(STEPS):
            mode = _mode(mode_name) if (rank == mode_rank and step == at) else None
            with mode if mode is not None else nullcontext():
                losses.append(_step(model, opt, step))
            if mode is not None:
                seen = _seen(mode_name, mode)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step, loss in enumerate(losses):  # the unsharded reference on the global batch
            x, y = token_batch(step, 8, 5, VOCAB)
            ref_loss = lm_loss(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            dist.all_reduce(loss, group=group)
            assert math.isclose(loss.item() / world, ref_loss.item(), rel_tol=1e-4), step
        return seen
    finally:
        if settings:
            for name, value in saved.items():
                setattr(_owner(name), name, value)


def _check(run_ranks, monkeypatch, world, transport, mode, mode_rank, at):
    if transport == "no_plugin":
        monkeypatch.setenv("HYPERFSDP_PLUGINS_DISABLE", "shm")
    args = (transport, mode, mode_rank, at)
    ours = run_ranks(world, train_with_mode_on_one_rank, "hyperfsdp", *args, timeout=120)
    theirs = run_ranks(world, train_with_mode_on_one_rank, "fsdp2", *args, timeout=120)
    assert [r for r, s in enumerate(ours) if s is not None] == [mode_rank]
    # the mode saw on that rank what it sees under FSDP2
    assert ours[mode_rank] == theirs[mode_rank], (ours[mode_rank], theirs[mode_rank])
    if mode == "flop_counter":
        assert ours[mode_rank]["flops"] > 0
    else:  # FSDP2's collectives of one step: all-gathers and reduce-scatters
        kinds = {op.split(".")[-1] for op in ours[mode_rank]}
        assert {"_allgather_base_", "_reduce_scatter_base_"} <= kinds, ours[mode_rank]


@pytest.mark.parametrize("mode", ["flop_counter", "comm_debug", "own"])
@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("world", [2, 4])
def test_mode_on_one_rank_trains_on(run_ranks, monkeypatch, world, transport, mode):
    """Rank 0's second step (its shared memory set up already) inside the mode."""
    _check(run_ranks, monkeypatch, world, transport, mode, mode_rank=0, at=1)


@pytest.mark.parametrize("transport", ["shm", "gloo_routes"])
@pytest.mark.parametrize("world", [2, 4])
def test_mode_on_one_rank_at_the_first_step(run_ranks, monkeypatch, world, transport):
    """The last rank's first step (lazy init, the shared memory's setup) inside the mode."""
    _check(run_ranks, monkeypatch, world, transport, "own", mode_rank=world - 1, at=0)
