"""Time gloo's collectives and the algorithms that can stand in for them, side by side.

    python benchmarks/collectives.py [--world-size 2] [--mib 1 4 16 64] [--repeats 7]

For each size (MiB of the full, unsharded tensor) it times, on CPU ranks over gloo:
all-gather as ``all_gather_into_tensor``, as ``all_gather`` into a list of views, and
as an all-reduce of a zero-padded buffer; reduce-scatter as ``reduce_scatter_tensor``,
as ``reduce_scatter`` from a list, and as an all-reduce followed by taking this rank's
slice (all-gather also as an integer all-reduce of the bit patterns, exact for every
value, -0.0 included); and the core's own: the point-to-point all-gather and, at
world 2, the pair reduce-scatter (a send, a receive and one addition); and the same two
through shared memory (the hyperfsdp-shm plugin: ``ag_shm``, ``rs_shm``), as its transport
runs them between the ranks of one host. It also says whether each stand-in's result is bitwise equal to
the native one. Median milliseconds over ``--repeats`` runs, slowest rank; and the peak
bytes malloc allocated inside each call beyond the caller's buffers (gloo's internal
staging), sampled with ``mallinfo2`` over all threads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # hyperfsdp_bench

import torch
import torch.distributed as dist

from hyperfsdp_core.testing import run_on_ranks


def _time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    mine = torch.tensor(statistics.median(times[1:]))
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine) * 1e3


def _variants(world, rank, shard, inp, out, views, zero_padded, grads, rs_out, work, p2p, shm):
    from hyperfsdp_shm import _transport as coll

    rows = [p2p.view(world, shard)]

    def ag_tensor():
        dist.all_gather_into_tensor(out, inp)

    def ag_list():
        dist.all_gather(views, inp)

    def ag_all_reduce():
        zero_padded.zero_()
        zero_padded[rank * shard : (rank + 1) * shard].copy_(inp)
        dist.all_reduce(zero_padded)

    def ag_all_reduce_int():  # integer sum of the bit patterns: exact for every value (-0.0)
        zero_padded.zero_()
        zero_padded[rank * shard : (rank + 1) * shard].copy_(inp)
        dist.all_reduce(zero_padded.view(torch.int32))

    def ag_p2p():  # the core's point-to-point all-gather (one member)
        rows[0][rank].copy_(inp)
        coll.all_gather_p2p(rows, rank, None).wait()

    def ag_shm():  # the core's shared-memory all-gather, row by row (one member)
        rows[0][rank].copy_(inp)
        shm.all_gather_rows(rows)

    def rs_tensor():
        dist.reduce_scatter_tensor(rs_out, grads)

    def rs_shm():  # the core's shared-memory two-rank reduce-scatter
        if world == 2:
            shm.reduce_scatter_pair(rs_out, grads)

    def rs_pair():  # the core's two-rank reduce-scatter (a send, a receive, one addition)
        if world == 2:
            coll.reduce_scatter_pair(rs_out, grads, dist.ReduceOp.SUM, None, rank).wait()

    def rs_list():
        dist.reduce_scatter(rs_out, list(grads.view(world, shard)))

    def rs_all_reduce():  # in place on a copy of the pack (the engine's pack is its own)
        work.copy_(grads)
        dist.all_reduce(work)

    return {
        "ag_tensor": ag_tensor,
        "ag_list": ag_list,
        "ag_all_reduce": ag_all_reduce,
        "ag_all_reduce_int": ag_all_reduce_int,
        "ag_p2p": ag_p2p,
        "ag_shm": ag_shm,
        "rs_tensor": rs_tensor,
        "rs_list": rs_list,
        "rs_all_reduce": rs_all_reduce,
        "rs_pair": rs_pair,
        "rs_shm": rs_shm,
    }


def _extra_heap(fn) -> int:
    """Peak bytes malloc had in use during ``fn()`` above what it had before (all threads)."""
    from hyperfsdp_bench.measure import HeapPeak

    dist.barrier()
    heap = HeapPeak(interval=0.0002)
    before = heap._in_use()
    with heap:
        fn()
    return (heap.peak or before) - before


def rank_main(mib_list, repeats):
    from datetime import timedelta

    from hyperfsdp_shm._shm import ShmGroup

    world, rank = dist.get_world_size(), dist.get_rank()
    shm = ShmGroup.create(None, rank, world, timedelta(minutes=5))
    if shm is None:
        raise RuntimeError("these ranks cannot map each other's shared memory")
    results = []
    for mib in mib_list:
        full = int(mib * 2**20 / 4) // world * world
        shard = full // world
        torch.manual_seed(rank)
        inp = torch.randn(shard)
        out = torch.empty(full)
        views = list(out.view(world, shard))
        zero_padded = torch.zeros(full)
        grads = torch.randn(full)
        rs_out = torch.empty(shard)
        work = grads.clone()
        p2p = torch.empty(full)
        fns = _variants(
            world, rank, shard, inp, out, views, zero_padded, grads, rs_out, work, p2p, shm
        )
        row = {"mib": mib}
        for name, fn in fns.items():
            row[name] = _time(fn, repeats)
            mine = torch.tensor(_extra_heap(fn), dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            row[f"{name}_extra_mib"] = float(mine) / 2**20
        fns["ag_tensor"]()
        reference = out.clone()
        fns["ag_all_reduce"]()
        row["ag_all_reduce_exact"] = bool(torch.equal(zero_padded, reference))
        fns["ag_all_reduce_int"]()
        row["ag_all_reduce_int_exact"] = bool(torch.equal(zero_padded, reference))
        fns["ag_p2p"]()
        row["ag_p2p_exact"] = bool(torch.equal(p2p, reference))
        p2p.zero_()
        fns["ag_shm"]()
        row["ag_shm_exact"] = bool(torch.equal(p2p, reference))
        fns["ag_list"]()
        row["ag_list_exact"] = bool(torch.equal(out, reference))
        fns["rs_tensor"]()
        reference = rs_out.clone()
        fns["rs_all_reduce"]()
        slice_ = work[rank * shard : (rank + 1) * shard]
        row["rs_all_reduce_exact"] = bool(torch.equal(slice_, reference))
        if world == 2:
            fns["rs_pair"]()
            row["rs_pair_exact"] = bool(torch.equal(rs_out, reference))
            rs_out.zero_()
            fns["rs_shm"]()
            row["rs_shm_exact"] = bool(torch.equal(rs_out, reference))
        else:
            row["rs_pair"] = row["rs_shm"] = float("nan")  # two ranks only
        fns["rs_list"]()
        row["rs_list_exact"] = bool(torch.equal(rs_out, reference))
        results.append(row)
    return results


COLS = (
    "ag_tensor",
    "ag_list",
    "ag_all_reduce",
    "ag_all_reduce_int",
    "ag_p2p",
    "ag_shm",
    "rs_tensor",
    "rs_list",
    "rs_all_reduce",
    "rs_pair",
    "rs_shm",
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mib", type=float, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    rows = run_on_ranks(args.world_size, rank_main, args.mib, args.repeats, timeout=1800)[0]
    print(
        f"gloo, {args.world_size} ranks, median ms (slowest rank); '*' = not bitwise equal to "
        "the native result"
    )
    print(f"{'MiB':>6}  " + "  ".join(f"{c:>17}" for c in COLS))
    for row in rows:
        cells = []
        for c in COLS:
            exact = row.get(f"{c}_exact", True)
            cells.append(f"{row[c]:>16.2f}{' ' if exact else '*'}")
        print(f"{row['mib']:>6g}  " + "  ".join(cells))
    print(
        "\nMiB malloc allocated inside the call beyond the caller's buffers (peak, max over "
        "ranks; the caller's: all-gather output and input, reduce-scatter input and output)"
    )
    print(f"{'MiB':>6}  " + "  ".join(f"{c:>17}" for c in COLS))
    for row in rows:
        print(f"{row['mib']:>6g}  " + "  ".join(f"{row[c + '_extra_mib']:>17.1f}" for c in COLS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
