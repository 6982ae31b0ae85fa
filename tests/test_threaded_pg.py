"""Ranks as threads of one process (torch's threaded process group, as FSDP2's own
``FSDPTestMultiThread`` tests run): every rank thread sees its own default group, so
nothing the core caches per process may be shared between the thread-ranks.

The threaded group lives in ``torch.testing._internal`` (private to torch's tests); it is
used here, in a test only, because it is how PyTorch runs FSDP2 with ranks as threads.
Each test runs the threads inside one harness rank process (``run_ranks(1, ...)``), so a
hang is bounded twice: by the threads' own deadline and by the harness timeout.
"""

from __future__ import annotations

import copy
import threading
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hyperfsdp_core.testing.reference import (
    Transformer,
    assert_close_params,
    full,
    lm_loss,
    local_slice,
    token_batch,
)

pytestmark = pytest.mark.skipif(
    torch.__version__ < (2, 13),
    reason="before torch 2.13 DTensor's sharding propagation crashes (SIGSEGV in "
    "FakeTensorMode.__enter__) when ranks are threads, under FSDP2 as under hyperfsdp",
)

#: seconds the rank threads get to train (a few steps take well under a second)
THREAD_DEADLINE = 60.0


def run_threaded(world: int, fn, *args, deadline: float = THREAD_DEADLINE) -> list:
    """``fn(*args)`` on ``world`` threads, each rank of a threaded process group (installed
    for the call, then the process's own world restored); results per rank. A rank's
    exception, or a rank still running after ``deadline`` seconds, fails the call."""
    # test-only use of torch's private threaded process group (see the module docstring)
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    results: list = [None] * world
    errors: list[str] = []
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=deadline))
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    world_of_threads = dist.distributed_c10d._world
    if not hasattr(world_of_threads, "comms"):  # torch 2.11's lacks what destroy reads
        world_of_threads.comms = []

    def worker(rank: int) -> None:
        try:
            dist.init_process_group(
                "threaded",
                rank=rank,
                world_size=world,
                store=store,
                timeout=timedelta(seconds=deadline),
            )
            try:
                results[rank] = fn(*args)
            finally:
                dist.destroy_process_group()
        except BaseException as exc:  # reported below, with the rank
            errors.append(f"rank {rank}:\n{traceback.format_exc()}")
            ProcessLocalGroup.exception_handle(exc)  # wake the ranks waiting for this one

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        end = threading.Event()
        timer = threading.Timer(deadline, end.set)
        timer.start()
        for t in threads:
            while t.is_alive() and not end.is_set():
                t.join(0.05)
        timer.cancel()
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            ProcessLocalGroup.exception_handle(TimeoutError())  # end collectives in flight
            for t in threads:
                t.join(5)
            raise TimeoutError(
                f"threaded ranks {stuck} of {world} still running after {deadline:.0f}s; "
                + "".join(errors)
            )
        if errors:
            raise RuntimeError("".join(errors))
        return results
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)


# -- training with thread-ranks -------------------------------------------------------------------

STEPS = 3
GLOBAL_BATCH = 8
SEQ, VOCAB = 5, 37


def build() -> Transformer:
    torch.manual_seed(0)
    return Transformer(vocab=VOCAB, dim=16, n_layers=3, hidden=27)


def shard_units(model: Transformer, fully_shard, layout: str, separate: bool) -> None:
    """A few units with different reshard policies: the blocks to groups of 2 after forward
    where the shard group allows an int (a post-forward mesh), the norm kept unsharded after
    forward, the head and the root as the default. ``"hsdp"``: over a (2, world/2) mesh,
    replicated over its first dim (the hsdp plugin's cached groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    raf = 2 if mesh.size(mesh.ndim - 1) == 4 else True
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=raf)
    fully_shard(model.norm, mesh=mesh, reshard_after_forward=False)
    fully_shard(model.output, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if separate:  # reduce-scatters on a second group over the shard ranks (cached too)
        model.set_separate_reduce_scatter_group(True)


def train_rank(copies: list[Transformer], impl: str, layout: str, separate: bool):
    """One thread-rank: shard its copy of the model, train, return the averaged losses and
    the full parameters."""
    model = copies[dist.get_rank()]
    if impl == "hyperfsdp":
        from hyperfsdp_core import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    world = dist.get_world_size()
    shard_units(model, fully_shard, layout, separate and impl == "hyperfsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x, y = token_batch(step, GLOBAL_BATCH, SEQ, VOCAB)
        loss = lm_loss(model(local_slice(x)), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
    if impl == "hyperfsdp":  # the threaded backend is not gloo: torch's own collectives
        from hyperfsdp_shm.plugin import ROOT_TRANSPORT

        from hyperfsdp_core.plugin import unit_of

        t = unit_of(model).root.stash.get(ROOT_TRANSPORT, None)
        assert t is None or (not any(t._is_gloo.values()) and not any(t._shm.values()))
    params = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    return losses, params


def train_reference(model: Transformer) -> tuple[list[float], Transformer]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x, y = token_batch(step, GLOBAL_BATCH, SEQ, VOCAB)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def threaded_training(world: int, impl: str, layout: str, separate: bool):
    """Runs in one harness rank: trains ``world`` thread-ranks twice in a row (the second
    time with new process groups, so nothing may survive from the first), then checks
    them against the unsharded reference."""
    model = build()
    ref_losses, ref = train_reference(copy.deepcopy(model))
    out = []
    for _ in range(2):
        copies = [copy.deepcopy(model) for _ in range(world)]
        results = run_threaded(world, train_rank, copies, impl, layout, separate)
        for losses, params in results:
            for got, want in zip(losses, ref_losses):
                assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (losses, ref_losses)
            trained = copy.deepcopy(ref)
            with torch.no_grad():
                for n, p in trained.named_parameters():
                    p.copy_(params[n])
            assert_close_params(trained, ref)
        out.append(results[0][0])
    return out


@pytest.mark.parametrize("world,layout", [(2, "fsdp"), (4, "fsdp"), (4, "hsdp")])
@pytest.mark.parametrize("impl", ["hyperfsdp", "fsdp2"])
def test_threaded_ranks_train_like_the_reference(run_ranks, world, layout, impl):
    """hyperfsdp trains with ranks as threads as FSDP2 does, at world 2 and 4, with a
    post-forward mesh (world 4), a separate reduce-scatter group and HSDP, twice in a row."""
    (runs,) = run_ranks(1, threaded_training, world, impl, layout, True, timeout=150)
    assert len(runs) == 2 and runs[0] == pytest.approx(runs[1], rel=1e-6)
