"""A rank killed while the shared-memory transport is set up (its segment made, the group
not yet built): the survivor's error says what failed and that the peer exited, and no
segment file stays behind, in a private segment directory (``HYPERFSDP_SHM_DIR``).

The ranks run in processes of their own (a killed rank would tear the rank pool down)."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hyperfsdp_shm import _shm

pytestmark = pytest.mark.skipif(not _shm.supported(), reason="needs Linux, x86-64 and /dev/shm")

TIMEOUT = 20.0  # the group's: the survivor must not need it (gloo sees the closed socket)


def _kill_self_at_map(n: int) -> None:
    """SIGKILL this process right after the plugin's ``n``-th ``mmap`` (1: its own
    segment, 2: the peer's)."""
    import mmap

    real, calls = mmap.mmap, [0]

    def spy(*args, **kwargs):
        mapped = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return mapped

    _shm.mmap.mmap = spy


def setup_rank(rank, world, store, shm_dir, kill_at, victim, out_dir) -> None:
    import torch.distributed as dist
    from hyperfsdp_shm.testing import created_segments
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from hyperfsdp_core import fully_shard

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["HYPERFSDP_SHM_DIR"] = shm_dir
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),  # a slow start on a loaded machine
    )
    dist.barrier()
    group = dist.new_group(timeout=timedelta(seconds=TIMEOUT))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    mesh = DeviceMesh.from_group(group, "cpu")
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    if rank == victim:
        _kill_self_at_map(kill_at)
    result: dict = {}
    start = time.monotonic()
    with created_segments() as created:
        try:
            model(torch.randn(2, 8)).sum().backward()  # the first gather sets shared memory up
        except Exception as exc:
            result.update(error=type(exc).__name__, notes=list(getattr(exc, "__notes__", [])))
    result["raised_after"] = time.monotonic() - start
    result["created"] = created
    (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown with a dead peer


@pytest.mark.parametrize("kill_at", [1, 2], ids=["own-segment-mapped", "peer-segment-mapped"])
def test_rank_killed_in_setup_leaves_no_segment(tmp_path, kill_at):
    victim, survivor = 1, 0
    shm_dir = tempfile.mkdtemp(prefix="hyperfsdp-test-", dir="/dev/shm")
    out = tmp_path / "out"
    out.mkdir()
    ctx = multiprocessing.get_context("spawn")
    args = (2, str(tmp_path / "store"), shm_dir, kill_at, victim, str(out))
    procs = [ctx.Process(target=setup_rank, args=(r, *args)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        procs[survivor].join(120 + 3 * TIMEOUT)
        left = sorted(os.listdir(shm_dir))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # a survivor still here is a hang
            p.join(10)
        shutil.rmtree(shm_dir, ignore_errors=True)
    assert procs[victim].exitcode == -signal.SIGKILL, procs[victim].exitcode
    r = json.loads((out / f"rank-{survivor}.json").read_text())
    # the survivor's segment was made in the private directory, and nothing is left there
    assert len(r["created"]) == 1 and Path(r["created"][0]).parent == Path(shm_dir), r
    assert left == [], left
    assert r.get("error") == "RuntimeError", r  # gloo's, with the plugin's note
    note = [n for n in r["notes"] if n.startswith("hyperfsdp-shm: ")]
    assert len(note) == 1, r["notes"]
    what = "setting up the shared-memory transport of the group (ranks [0, 1]) failed"
    assert what in note[0], note
    assert f"group rank {victim} (pid {procs[victim].pid}) exited" in note[0], note
    assert f"every member's segment file in {shm_dir} was removed" in note[0], note
    assert r["raised_after"] < TIMEOUT, r
