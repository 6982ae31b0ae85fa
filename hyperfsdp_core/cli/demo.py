"""``hyperfsdp demo``: train a small transformer on CPU ranks and check it against a reference.

The command starts its own rank processes (gloo), shards a Llama-like model per block
and at the root, trains it with AdamW while an unsharded copy trains on the same
global batch in each process, and exits 0 only if losses and final parameters agree.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time


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
    p.add_argument("--atol", type=float, default=2e-4, help="parameter tolerance (default: 2e-4)")
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
    """The model sharded per block and at the root, its unsharded copy (the reference) and
    the model's unsharded parameter bytes."""
    import torch

    from hyperfsdp_core import fully_shard
    from hyperfsdp_core.testing.reference import Transformer

    torch.manual_seed(0)
    model = Transformer(
        vocab=vocab, dim=dim, n_layers=layers, n_heads=4, hidden=3 * dim - 5, tied=tied
    )
    ref = copy.deepcopy(model)
    unsharded_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model, ref, unsharded_bytes


def _progress_bar(steps: int, world: int):
    """Rank 0's progress bar, or None without tqdm (it comes with the demo extra:
    ``pip install hyperfsdp[demo]``)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=steps, desc=f"training on {world} ranks", unit="step", file=sys.stderr)


def _train(model, ref, steps: int, shape: tuple[int, int, int], bar) -> tuple[list, float]:
    """Train ``model`` and ``ref`` with AdamW on the same global batches (``shape``: batch,
    sequence, vocabulary); the losses averaged over ranks and the largest gap between
    those and the reference's."""
    import torch
    import torch.distributed as dist

    from hyperfsdp_core.testing.reference import lm_loss, local_slice

    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=5e-3)
    losses, worst_loss_gap = [], 0.0
    for step in range(steps):
        x, y = _token_batch(step, *shape)
        loss = lm_loss(model(local_slice(x)), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        avg = avg.item() / dist.get_world_size()
        losses.append(avg)
        worst_loss_gap = max(worst_loss_gap, abs(avg - ref_loss.item()))
        if bar is not None:
            bar.set_postfix(loss=f"{avg:.4f}", ref=f"{ref_loss.item():.4f}")
            bar.update()
    if bar is not None:
        bar.close()
    return losses, worst_loss_gap


def _rank_main(steps: int, layers: int, dim: int, tied: bool, atol: float) -> dict:
    import torch.distributed as dist

    from hyperfsdp_core.testing.reference import full

    rank, world = dist.get_rank(), dist.get_world_size()
    vocab, seq, batch = 503, 16, 4 * world  # vocab and MLP width not divisible by the world size
    model, ref, unsharded_bytes = _build_models(layers, dim, tied, vocab)
    bar = _progress_bar(steps, world) if rank == 0 else None
    start = time.perf_counter()
    losses, worst_loss_gap = _train(model, ref, steps, (batch, seq, vocab), bar)
    elapsed = time.perf_counter() - start
    ref_params = dict(ref.named_parameters())
    worst_param = max(
        (full(p.detach()) - ref_params[n].detach()).abs().max().item()
        for n, p in model.named_parameters()
    )
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    plan = str(model.sharding_plan()) if rank == 0 else ""
    return {
        "losses": losses,
        "loss_gap": worst_loss_gap,
        "param_gap": worst_param,
        "local_bytes": local_bytes,
        "unsharded_bytes": unsharded_bytes,
        "plan": plan,
        "seconds": elapsed,
        "ok": worst_param <= atol and worst_loss_gap <= atol * 10,
    }


def run(args: argparse.Namespace) -> int:
    from ..testing.pool import close_pools, run_on_ranks

    print(
        f"hyperfsdp demo: {args.world_size} CPU ranks (gloo), {args.layers} blocks, width {args.dim}, "
        f"{'tied' if args.tied else 'untied'} head, {args.steps} AdamW steps",
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
            args.atol,
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
    print(
        f"\nloss {r0['losses'][0]:.4f} -> {r0['losses'][-1]:.4f} in {r0['seconds']:.1f}s; "
        f"largest loss gap {max(r['loss_gap'] for r in results):.2e}, "
        f"largest parameter gap {max(r['param_gap'] for r in results):.2e} (tolerance {args.atol:g})"
    )
    if all(r["ok"] for r in results):
        print("parity with the single-process reference: OK")
        return 0
    print("parity with the single-process reference: FAILED", file=sys.stderr)
    return 1
