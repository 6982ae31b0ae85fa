"""A two-rank job whose checkpoint directory is on a tmpfs that fills up (for
``test_faults.py::test_full_disk_is_named``). Run inside a private mount namespace
(``unshare -m``, or ``unshare -rm`` without root): it mounts a small tmpfs at MOUNT,
saves step 2, fills the tmpfs to a few KiB, fails to save step 4, frees the space, saves
step 4, and writes what each rank saw to OUT_DIR/rank-<r>.json.

    python full_disk_job.py MOUNT STORE OUT_DIR

Exit status 3 when the tmpfs cannot be mounted (the test then skips).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the tmpfs: room for two checkpoints of the model (2.6 MiB each: weights and AdamW's two
#: moments, 1.3 MiB per rank), filled up to ``LEFT_FREE`` before the third, so that the
#: disk fills up in the middle of a tensor (where ``torch.save`` loses the OSError)
SIZE = 8 << 20
DIMS = [64, 512, 512, 64]
LEFT_FREE = 256 << 10


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full, then give back ``LEFT_FREE`` bytes."""
    chunk = bytes(4096)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
    os.truncate(path, max(0, path.stat().st_size - LEFT_FREE))


def train_step(model, opt, step: int) -> None:
    torch.manual_seed(100 + step)
    model(torch.randn(4, DIMS[0])).square().mean().backward()
    opt.step()
    opt.zero_grad()


def rank_main(rank: int, world: int, mount: str, store: str, out_dir: str) -> None:
    from dcp_testlib import optimizer, shard
    from hyperfsdp_dcp import CheckpointManager, CheckpointSaveError

    from hyperfsdp_core.testing.reference import MLPStack

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    root = Path(mount) / "ckpt"
    filler = Path(mount) / "filler"
    torch.manual_seed(0)
    model = shard(MLPStack(DIMS))
    opt = optimizer(model)
    manager = CheckpointManager(root, model=model, optimizer=opt)
    result: dict = {}
    for step in range(2):
        train_step(model, opt, step)
    manager.save(2)
    train_step(model, opt, 2)
    dist.barrier()
    if rank == 0:
        fill(filler)
    dist.barrier()
    try:
        manager.save(4)
    except CheckpointSaveError as exc:
        result.update(message=str(exc), ranks=exc.ranks, step=exc.step)
    dist.barrier()
    result["after_failure"] = manager.steps()
    if rank == 0:
        filler.unlink()
    dist.barrier()
    manager.save(4)  # room again: the next save works
    result["after_freeing"] = manager.steps()
    manager.close()
    (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    mount, store, out_dir = sys.argv[1:4]
    os.makedirs(mount, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", mount],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        print(f"cannot mount a tmpfs: {mounted.stderr.strip()}", file=sys.stderr)
        sys.exit(3)
    try:
        mp.spawn(rank_main, args=(2, mount, store, out_dir), nprocs=2, join=True)
    finally:
        subprocess.run(["umount", mount], check=False)


if __name__ == "__main__":
    main()
