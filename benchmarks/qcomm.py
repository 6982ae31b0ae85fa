"""Quantized collectives (plugin ``hyperfsdp-qcomm``) side by side with fp32 communication.

    python benchmarks/qcomm.py [--world-size 2 4] [--steps 20] [--curve-steps 200]

Two parts, on CPU ranks over gloo:

- **loss curves**: the small transformer of ``plugins/qcomm/tests`` (vocab 64, dim 64, two
  blocks; a learnable counting task) trained ``--curve-steps`` steps with fp32
  communication and with qcomm (int8 all-gather; int8 or bf16 reduce-scatter, fp32
  accumulation): the final loss (last step, and the mean of the last 10) relative to fp32's,
  and the largest relative gap along the curve.
- **step time and bytes**: a larger transformer (``--dim``, ``--layers``) trained ``--steps``
  steps by torch FSDP2, FSDP2 carrying qcomm's comm objects (``set_custom_all_gather`` /
  ``set_custom_reduce_scatter``), hyperfsdp (qcomm off) and hyperfsdp with qcomm: median
  step time (slowest rank) and bytes per step: the logical fp32 collectives (hyperfsdp's
  collective observer) and what qcomm put on the wire (``hyperfsdp_qcomm.WIRE_BYTES``).

On one host the gloo wire is memory copies: time measures qcomm's compute overhead more
than the bandwidth it saves (which is what matters between hosts).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from hyperfsdp_core.testing import run_on_ranks

CURVE_VOCAB = 64
MODES = {"int8/int8": ("int8", "int8"), "int8/bf16": ("int8", "bf16")}


def _batch(step: int, vocab: int, n: int = 32, seq: int = 16):
    g = torch.Generator().manual_seed(3000 + step)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    noise = torch.rand(tokens.shape, generator=g) < 0.25  # an entropy floor: a stable end loss
    tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _shard(model, impl) -> None:
    for block in model.layers:
        impl(block)
    impl(model)


def rank_run(impl: str, mode, steps: int, dim: int, layers: int, vocab: int, timed: bool) -> dict:
    import hyperfsdp_qcomm
    from hyperfsdp_qcomm import QCommPolicy
    from hyperfsdp_qcomm.plugin import QuantizedAllGather, QuantizedReduceScatter

    from hyperfsdp_core import fully_shard
    from hyperfsdp_core.plugin import hookimpl
    from hyperfsdp_core.testing import registered
    from hyperfsdp_core.testing.reference import Transformer, lm_loss, local_slice

    observed = collections.Counter()

    class Recorder:
        @hookimpl
        def hyperfsdp_collective_observer(self, root):
            return lambda e: observed.update({e.kind: e.nbytes})

    torch.manual_seed(0)
    hidden = 3 * dim - 5 if dim > 64 else 160
    model = Transformer(vocab=vocab, dim=dim, n_layers=layers, n_heads=4, hidden=hidden)
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as fsdp2

        _shard(model, fsdp2)
        if mode is not None:
            policy = QCommPolicy(*MODES[mode], 256, 0)
            for m in (*model.layers, model):
                m.set_custom_all_gather(QuantizedAllGather(policy, "fsdp2"))
                m.set_custom_reduce_scatter(QuantizedReduceScatter(policy, "fsdp2"))
    else:
        if mode is not None:
            hyperfsdp_qcomm.enable(
                model, all_gather=MODES[mode][0], reduce_scatter=MODES[mode][1], min_numel=0
            )
        _shard(model, fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    hyperfsdp_qcomm.WIRE_BYTES.clear()
    losses, times = [], []
    with registered(Recorder(), "qcomm_bench_recorder"):
        for step in range(steps):
            x, y = _batch(step, vocab)
            dist.barrier()
            t0 = time.perf_counter()
            loss = lm_loss(model(local_slice(x)), local_slice(y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            losses.append(avg.item() / dist.get_world_size())
    wire = collections.Counter()
    for (_, kind, _route), n in hyperfsdp_qcomm.WIRE_BYTES.items():
        wire[kind] += n
    warm = times[2:] if timed and len(times) > 4 else times
    t = torch.tensor(statistics.median(warm))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {
        "losses": losses,
        "median_s": float(t),
        "observed": {k: v / steps for k, v in observed.items()},
        "wire": {k: v / steps for k, v in wire.items()},
    }


def curves(world: int, steps: int) -> None:
    print(f"\n## loss curves, world {world}, {steps} steps (vocab {CURVE_VOCAB}, dim 64, 2 blocks)")
    base = run_on_ranks(
        world, rank_run, "hyperfsdp", None, steps, 64, 2, CURVE_VOCAB, False, timeout=3600
    )[0]
    b = base["losses"]
    print(
        f"fp32 comm: first {b[0]:.4f}  last {b[-1]:.4f}  mean(last 10) {statistics.mean(b[-10:]):.4f}"
    )
    for mode in MODES:
        q = run_on_ranks(
            world, rank_run, "hyperfsdp", mode, steps, 64, 2, CURVE_VOCAB, False, timeout=3600
        )[0]["losses"]
        last = (q[-1] - b[-1]) / b[-1]
        tail = (statistics.mean(q[-10:]) - statistics.mean(b[-10:])) / statistics.mean(b[-10:])
        gap = max(abs(x - y) / y for x, y in zip(q, b))
        print(
            f"qcomm {mode}: last {q[-1]:.4f} ({last:+.2%})  mean(last 10) {statistics.mean(q[-10:]):.4f} "
            f"({tail:+.2%})  largest gap along the curve {gap:.2%}"
        )


def timing(world: int, steps: int, dim: int, layers: int) -> None:
    vocab = 512
    print(
        f"\n## step time and bytes per step, world {world}, dim {dim}, {layers} blocks, {steps} steps"
    )
    print(
        "| impl | qcomm | median step (ms) | all-gather MB/step (logical / wire) | reduce-scatter MB/step (logical / wire) |"
    )
    print("|---|---|---|---|---|")
    logical = None
    for impl, mode in [  # hyperfsdp without qcomm first: its observer gives the logical bytes
        ("hyperfsdp", None),
        ("hyperfsdp", "int8/int8"),
        ("hyperfsdp", "int8/bf16"),
        ("fsdp2", None),
        ("fsdp2", "int8/int8"),
    ]:
        r = run_on_ranks(
            world, rank_run, impl, mode, steps, dim, layers, vocab, True, timeout=3600
        )[0]
        if impl == "hyperfsdp" and mode is None:
            logical = r["observed"]
        lg = r["observed"] or logical or {}
        cells = []
        for kind in ("all_gather", "reduce_scatter"):
            lo = lg.get(kind)
            wi = r["wire"].get(kind)
            lo_s = f"{lo / 1e6:.2f}" if lo else "-"
            wi_s = f"{wi / 1e6:.2f} ({wi / lo:.3f}x)" if wi and lo else "-"
            cells.append(f"{lo_s} / {wi_s}")
        print(f"| {impl} | {mode or 'off'} | {r['median_s'] * 1e3:.1f} | {cells[0]} | {cells[1]} |")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world-size", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--curve-steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--no-curves", action="store_true")
    p.add_argument("--no-timing", action="store_true")
    args = p.parse_args()
    for world in args.world_size:
        if not args.no_curves:
            curves(world, args.curve_steps)
        if not args.no_timing:
            timing(world, args.steps, args.dim, args.layers)


if __name__ == "__main__":
    main()
