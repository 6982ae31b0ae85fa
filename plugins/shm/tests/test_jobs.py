"""Jobs and failures as a user meets them: two jobs on one host, training with the plugin
on and off against the unsharded reference, and a collective that fails with an error of
its own making the group fail clearly on every rank instead of going out of step."""

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hyperfsdp_shm import _shm

pytestmark = pytest.mark.skipif(not _shm.supported(), reason="needs Linux, x86-64 and /dev/shm")

JOB = Path(__file__).with_name("job.py")


def test_two_jobs_on_one_host_train_on_their_own_segments(tmp_path):
    outs = [tmp_path / f"job{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for out in outs
    ]
    try:
        logs = [p.communicate(timeout=300)[0].decode()[-3000:] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, out, log in zip(procs, outs, logs):
        assert p.returncode == 0 and out.exists(), log
        results.append(json.loads(out.read_text()))
    a, b = results
    # each trained against its unsharded reference (train_parity asserts it every step)
    # through shared memory, with the same losses: the jobs did not see each other's bytes
    assert a["used"] == b["used"] == 1
    assert a["losses"] == b["losses"]
    assert a["segments"] and b["segments"]
    assert not set(a["segments"]) & set(b["segments"])  # distinct segment names
    left = [s for s in a["segments"] + b["segments"] if Path(s).exists()]
    assert left == []  # unlinked once mapped


def train_against_reference(enabled: bool):
    from hyperfsdp_shm.plugin import ROOT_TRANSPORT

    from hyperfsdp_core import fully_shard
    from hyperfsdp_core.plugin import unit_of
    from hyperfsdp_core.testing import shared_memory
    from hyperfsdp_core.testing.reference import Transformer, lm_loss, token_batch, train_parity

    roots = []

    def shard(model):
        for block in model.layers:
            fully_shard(block)
        roots.append(fully_shard(model))

    with shared_memory(enabled):
        out = train_parity(
            lambda: Transformer(vocab=33, dim=16, n_layers=3, hidden=24),
            shard,
            lambda step: token_batch(step, 8, 5, 33),
            lm_loss,
            steps=3,
        )
    transport = unit_of(roots[0]).root.stash[ROOT_TRANSPORT]  # None: the core's gloo routes
    return out["losses"], transport is not None and any(
        g is not None for g in transport._shm.values()
    )


@pytest.mark.parametrize("world", [2, 4])
def test_training_with_shared_memory_on_and_off_matches_the_reference(run_ranks, world):
    # train_parity asserts losses and parameters against the unsharded reference trained
    # on the global batch (fp32 tolerance) at every step; both ways give the same losses
    on = run_ranks(world, train_against_reference, True)
    off = run_ranks(world, train_against_reference, False)
    assert [used for _, used in on] == [True] * world
    assert [used for _, used in off] == [False] * world
    assert on[0][0] == off[0][0]


def failing_copy():
    """Rank 0 fails inside a shared-memory all-gather with an error of its own (a copy
    into its slot raises); rank 1 waits for that all-gather's chunk."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    transport = _shm.ShmGroup.create(None, rank, world, timedelta(seconds=60))
    errors = []
    start = time.monotonic()
    if rank == 0:
        slots = transport._slots[0]
        transport._slots[0] = [None] * len(slots)  # put() fails: TypeError
        try:
            transport.all_gather(torch.empty(8), torch.ones(4))
        except TypeError:
            errors.append("TypeError")
        transport._slots[0] = slots
    try:  # every later collective fails clearly, on every rank
        transport.all_gather(torch.empty(8), torch.ones(4))
    except _shm.ShmCollectiveError as exc:
        errors.append(str(exc))
    return errors, time.monotonic() - start


def test_an_error_inside_a_collective_fails_the_group_on_every_rank(run_ranks):
    (err0, _), (err1, waited1) = run_ranks(2, failing_copy, timeout=120)
    assert err0[0] == "TypeError"
    assert "failed earlier" in err0[1] and "TypeError inside shared-memory collective" in err0[1]
    # rank 1 learns it at once (not after the group's 60 s timeout, nor out of step)
    assert len(err1) == 1 and "group rank 0 failed during shared-memory collective" in err1[0]
    assert waited1 < 10, waited1
