"""``hyperfsdp demo``: train a small transformer on CPU ranks and check it against a reference.

The command starts its own rank processes (gloo), shards a Llama-like model per block and at
the root, and trains it with AdamW; in each process an unsharded copy (the reference) and a
copy sharded by torch's own FSDP2 train on the same global batches. It exits 0 only if
hyperfsdp's losses, gradient norms and final parameters are as close to the reference's as
FSDP2's are on this machine: sharding changes the order of floating-point sums, so neither
matches the reference bit for bit, and how far the rounding drifts after many AdamW steps
depends on the CPU. Each of hyperfsdp's gaps must be at most ``--slack`` times FSDP2's gap
plus a few units in the last place of the compared values (the floor for a machine where
FSDP2 matches exactly). A real fault (gradients not averaged, stale parameters after a
skipped reshard) is orders of magnitude past that.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

#: Units in the last place (float32) of the largest compared value, allowed whatever FSDP2's gap.
FLOOR_ULPS = 16
METRICS = ("losses", "gradient norms", "parameters")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="train a small sharded transformer on CPU ranks and check parity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--world-size", type=int, default=4, help="number of CPU ranks (default: 4)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default: 30)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default: 4)")
    p.add_argument("--dim", type=int, default=64, help="model width (default: 64)")
    p.add_argument("--tied", action="store_true", help="tie the output head to the embedding")
    p.add_argument(
        "--slack",
        type=float,
        default=4.0,
        help="each gap to the reference may be this many times FSDP2's (default: 4)",
    )
    p.set_defaults(func=run)


def _token_batch(step: int, n: int, seq: int, vocab: int):
    """Learnable sequences: arithmetic progressions mod ``vocab`` with a random start and
    stride; ``(inputs, targets)``."""
    import torch

    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def _build_models(layers: int, dim: int, tied: bool, vocab: int):
    """The model sharded by hyperfsdp per block and at the root, the same model sharded so by
    torch's FSDP2, the unsharded copy (the reference) and the model's unsharded parameter
    bytes."""
    import torch
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from hyperfsdp_core import fully_shard
    from hyperfsdp_core.testing.reference import Transformer

    torch.manual_seed(0)
    model = Transformer(
        vocab=vocab, dim=dim, n_layers=layers, n_heads=4, hidden=3 * dim - 5, tied=tied
    )
    ref, fsdp2 = copy.deepcopy(model), copy.deepcopy(model)
    unsharded_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for shard, m in ((fully_shard, model), (fsdp2_fully_shard, fsdp2)):
        for block in m.layers:
            shard(block)
        shard(m)
    return model, fsdp2, ref, unsharded_bytes


def _progress_bar(steps: int, world: int):
    """Rank 0's progress bar, or None without tqdm (it comes with the demo extra:
    ``pip install hyperfsdp[demo]``)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=steps, desc=f"training on {world} ranks", unit="step", file=sys.stderr)


class _Run:
    """One model in training: its optimizer, and per step the loss (averaged over ranks for
    a sharded model, which sees its rank's slice of the batch) and the gradient norm."""

    def __init__(self, model, sharded: bool) -> None:
        import torch

        self.model, self.sharded = model, sharded
        self.opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
        self.losses: list[float] = []
        self.norms: list[float] = []

    def step(self, x, y) -> None:
        import torch
        import torch.distributed as dist

        from hyperfsdp_core.testing.reference import full, lm_loss, local_slice

        if self.sharded:
            x, y = local_slice(x), local_slice(y)
        loss = lm_loss(self.model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf"))
        self.opt.step()
        self.opt.zero_grad()
        loss = loss.detach().clone()
        if self.sharded:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(loss.item())
        self.norms.append(full(norm).item())


def _train(runs: dict, steps: int, shape: tuple[int, int, int], bar) -> None:
    """Train every run on the same global batches (``shape``: batch, sequence, vocabulary)."""
    for step in range(steps):
        x, y = _token_batch(step, *shape)
        for run in runs.values():
            run.step(x, y)
        if bar is not None:
            ours, ref = runs["hyperfsdp"].losses[-1], runs["reference"].losses[-1]
            bar.set_postfix(loss=f"{ours:.4f}", ref=f"{ref:.4f}")
            bar.update()
    if bar is not None:
        bar.close()


def _gaps(run, ref) -> dict[str, float]:
    """The largest difference to the reference of each metric (losses and gradient norms
    over the steps, final parameters over every element)."""
    from hyperfsdp_core.testing.reference import full

    ref_params = dict(ref.model.named_parameters())
    return {
        "losses": max(abs(a - b) for a, b in zip(run.losses, ref.losses)),
        "gradient norms": max(abs(a - b) for a, b in zip(run.norms, ref.norms)),
        "parameters": max(
            (full(p.detach()) - ref_params[n].detach()).abs().max().item()
            for n, p in run.model.named_parameters()
        ),
    }


def _floors(ref) -> dict[str, float]:
    """:data:`FLOOR_ULPS` units in the last place of the largest reference value of each
    metric."""
    import torch

    eps = torch.finfo(torch.float32).eps
    largest_param = max(p.detach().abs().max().item() for p in ref.model.parameters())
    return {
        "losses": FLOOR_ULPS * eps * max(abs(v) for v in ref.losses),
        "gradient norms": FLOOR_ULPS * eps * max(ref.norms),
        "parameters": FLOOR_ULPS * eps * largest_param,
    }


def parity(ours: dict, fsdp2: dict, floors: dict, slack: float) -> dict[str, tuple]:
    """For each metric: hyperfsdp's gap to the reference, FSDP2's, the tolerance derived
    from them (``slack`` times FSDP2's gap plus the floor) and whether hyperfsdp's is within."""
    out = {}
    for metric in METRICS:
        tolerance = slack * fsdp2[metric] + floors[metric]
        out[metric] = (ours[metric], fsdp2[metric], tolerance, ours[metric] <= tolerance)
    return out


def _rank_main(steps: int, layers: int, dim: int, tied: bool, slack: float, perturb=None) -> dict:
    """One rank's demo. ``perturb(model)``, if given, is applied to hyperfsdp's sharded model
    before training (the tests break the training on purpose to show the check fails)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    vocab, seq, batch = 503, 16, 4 * world  # vocab and MLP width not divisible by the world size
    model, fsdp2, ref, unsharded_bytes = _build_models(layers, dim, tied, vocab)
    if perturb is not None:
        perturb(model)
    runs = {
        "hyperfsdp": _Run(model, sharded=True),
        "fsdp2": _Run(fsdp2, sharded=True),
        "reference": _Run(ref, sharded=False),
    }
    bar = _progress_bar(steps, world) if rank == 0 else None
    start = time.perf_counter()
    _train(runs, steps, (batch, seq, vocab), bar)
    elapsed = time.perf_counter() - start
    check = parity(
        _gaps(runs["hyperfsdp"], runs["reference"]),
        _gaps(runs["fsdp2"], runs["reference"]),
        _floors(runs["reference"]),
        slack,
    )
    local_bytes = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    return {
        "losses": runs["hyperfsdp"].losses,
        "parity": check,
        "local_bytes": local_bytes,
        "unsharded_bytes": unsharded_bytes,
        "plan": str(model.sharding_plan()) if rank == 0 else "",
        "seconds": elapsed,
        "ok": all(within for *_, within in check.values()),
    }


def _local(param):
    """A sharded parameter's local shard (a parameter left unsharded: the whole of it)."""
    return param.to_local() if hasattr(param, "to_local") else param


def run(args: argparse.Namespace) -> int:
    from ..testing.pool import close_pools, run_on_ranks

    print(
        f"hyperfsdp demo: {args.world_size} CPU ranks (gloo), {args.layers} blocks, width {args.dim}, "
        f"{'tied' if args.tied else 'untied'} head, {args.steps} AdamW steps; the same model "
        "unsharded (the reference) and sharded by torch's FSDP2 trains alongside",
        flush=True,
    )
    try:
        results = run_on_ranks(
            args.world_size,
            _rank_main,
            args.steps,
            args.layers,
            args.dim,
            args.tied,
            args.slack,
            timeout=1800,
        )
    finally:
        close_pools()
    r0 = results[0]
    print("\nsharding plan (rank 0):")
    print(r0["plan"])
    print("\nparameter memory per rank (sharded vs unsharded):")
    for rank, r in enumerate(results):
        share = r["local_bytes"] / r["unsharded_bytes"]
        print(
            f"  rank {rank}: {r['local_bytes'] / 1024:9.1f} KiB of {r['unsharded_bytes'] / 1024:.1f} KiB ({share:.1%})"
        )
    print(f"\nloss {r0['losses'][0]:.4f} -> {r0['losses'][-1]:.4f} in {r0['seconds']:.1f}s")
    print(_parity_table(results, args.slack))
    if all(r["ok"] for r in results):
        print("parity with the single-process reference: OK (as close as torch's FSDP2)")
        return 0
    print(
        "parity with the single-process reference: FAILED (further than torch's FSDP2)",
        file=sys.stderr,
    )
    return 1


def _parity_table(results: list[dict], slack: float) -> str:
    """The largest gap of each metric over the ranks, for hyperfsdp and FSDP2, and the
    tolerance (the smallest over the ranks)."""
    lines = [
        f"largest gap to the reference   hyperfsdp    FSDP2        tolerance ({slack:g} x FSDP2 + floor)"
    ]
    for metric in METRICS:
        rows = [r["parity"][metric] for r in results]
        ours = max(row[0] for row in rows)
        theirs = max(row[1] for row in rows)
        tolerance = min(row[2] for row in rows)
        mark = "ok" if all(row[3] for row in rows) else "TOO LARGE"
        lines.append(f"  {metric:<29}{ours:<13.2e}{theirs:<13.2e}{tolerance:<10.2e} {mark}")
    return "\n".join(lines)
