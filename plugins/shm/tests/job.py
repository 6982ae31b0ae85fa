"""One training job of two CPU ranks on this host (for ``test_jobs.py``): spawns its ranks
itself, rendezvous through a file, trains with the plugin's shared memory against the
unsharded reference (``train_parity``), and writes what it saw to a JSON file.

    python job.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, store_path: str, out: str) -> None:
    from hyperfsdp_shm.plugin import ROOT_TRANSPORT
    from hyperfsdp_shm.testing import created_segments

    from hyperfsdp_core import fully_shard
    from hyperfsdp_core.plugin import unit_of
    from hyperfsdp_core.testing.reference import MLPStack, mlp_batch, mse_loss, train_parity

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    roots = []

    def shard(model):
        for layer in model.layers:
            fully_shard(layer)
        roots.append(fully_shard(model))

    with created_segments() as created:
        result = train_parity(
            lambda: MLPStack([16, 40, 33, 16]),
            shard,
            lambda step: mlp_batch(step, 8, 16),
            mse_loss,
            steps=4,
        )
    transport = unit_of(roots[0]).root.stash[ROOT_TRANSPORT]
    used = sum(g is not None for g in transport._shm.values())
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": result["losses"], "segments": created, "used": used}, f)
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), out), nprocs=2, join=True)


if __name__ == "__main__":
    main()
