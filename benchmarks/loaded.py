"""Training steps on a host whose cores other processes compete for (``--load N``).

    python benchmarks/loaded.py [--world-size 2] [--load 2] [--steps 30] [--rounds 2]

Training hosts are shared (data loaders, other jobs): a rank that waits for its peers must
not burn the core a peer or another process needs. This runs the same small Transformer
(the test harness's, 8 layers of dim 64) on ``--world-size`` CPU ranks with ``--load``
busy processes spinning beside them, for each of:

- ``shm``: hyperfsdp with the hyperfsdp-shm plugin's shared memory (its default);
- ``core``: the core alone (``HYPERFSDP_SHM=0``: the plugin supplies no transport, as
  when it is not installed): the core's gloo routes without gloo's full-size buffers;
- ``native``: gloo's own collectives (``HYPERFSDP_GLOO_NATIVE_COLLECTIVES=1``), as FSDP2
  runs them;
- ``fsdp2``: torch's ``fully_shard``.

Interleaved rounds (each variant once per round); it prints seconds per step (median over
rounds, slowest rank) and each variant's ratio to FSDP2. A benchmark, not a test: the
figures depend on the machine (docs/performance.md has measured ones).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from hyperfsdp_core.testing import close_pools, run_on_ranks
from hyperfsdp_core.testing.reference import Transformer, lm_loss, local_slice, token_batch

VARIANTS = {
    "shm": {"HYPERFSDP_SHM": "1"},
    "core": {"HYPERFSDP_SHM": "0"},
    "native": {"HYPERFSDP_GLOO_NATIVE_COLLECTIVES": "1"},
    "fsdp2": {},
}
VOCAB, DIM, LAYERS, HIDDEN, BATCH, SEQ = 512, 64, 8, 256, 8, 32


def rank_steps(variant: str, steps: int, warmup: int) -> float:
    """Seconds per training step of ``variant`` on this rank (after ``warmup`` steps)."""
    saved = {k: os.environ.get(k) for k in VARIANTS[variant]}
    os.environ.update(VARIANTS[variant])
    try:
        if variant == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            from hyperfsdp_core import fully_shard
        torch.manual_seed(0)
        model = Transformer(vocab=VOCAB, dim=DIM, n_layers=LAYERS, hidden=HIDDEN)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        start = 0.0
        for step in range(warmup + steps):
            if step == warmup:
                dist.barrier()
                start = time.perf_counter()
            x, y = token_batch(step, BATCH * dist.get_world_size(), SEQ, VOCAB)
            lm_loss(model(local_slice(x)), local_slice(y)).backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - start) / steps
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--load", type=int, default=2, help="busy processes beside the ranks")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variant", action="append", choices=list(VARIANTS), help="default: all")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    variants = args.variant or list(VARIANTS)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    load = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.load)]
    for proc in load:
        proc.start()
    times: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for _ in range(args.rounds):
            for v in variants:
                per_rank = run_on_ranks(
                    args.world_size, rank_steps, v, args.steps, args.warmup, timeout=1800
                )
                times[v].append(max(per_rank))
    finally:
        stop.set()
        for proc in load:
            proc.join()
        close_pools()
    print(
        f"world {args.world_size}, {args.load} busy processes on {os.cpu_count()} cores, "
        f"{args.steps} steps x {args.rounds} rounds: s/step (median, slowest rank)"
    )
    base = statistics.median(times["fsdp2"]) if "fsdp2" in times else None
    for v in variants:
        med = statistics.median(times[v])
        ratio = f"  {med / base:.2f}x fsdp2" if base else ""
        runs = ", ".join(f"{t:.4f}" for t in times[v])
        print(f"{v:>8}  {med:.4f}{ratio}   ({runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
