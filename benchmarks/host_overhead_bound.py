"""How low can an FSDP's host overhead per unit go at world size 1?

``python benchmarks/host_overhead_bound.py [--steps 200] [--clock cpu|wall]``

Trains the ``host-overhead`` model (64 tiny blocks, 65 units) at world size 1 with
torch's default ``AdamW`` (on CPU: the per-parameter loop) in four ways, all in one
process, a step of each in turn (the order rotating every step), so that the machine's
drift hits them alike (separate processes per way differed by up to 40% here):

- ``floor``: the plain model, no FSDP;
- ``skeleton``: the least an FSDP with FSDP2's interface can do. Parameters are
  ``DTensor`` s outside forward and backward (what the optimizer and checkpoints see)
  and plain tensors inside; the skeleton swaps them in ``module._parameters`` from
  forward hooks and a gradient hook per unit, applies an autograd identity to each
  unit's input (where an FSDP learns that a unit's backward is done), and hands every
  gradient to its parameter as a ``DTensor``. Nothing else: no communication, no
  buffers, no state machine, no checks. At world size 1 a shard is the whole tensor,
  so the ``DTensor`` s share memory with the plain parameters and the skeleton trains
  exactly as the floor does (checked: equal losses);
- ``hyperfsdp`` and ``fsdp2``: ``fully_shard`` on every block and the root.

It prints, per way, the forward+backward and optimizer time per step, and the host
overhead per unit (step minus the floor's, over 65 units) with its engine part
(forward+backward minus the floor's), as ratios to FSDP2's, and whether each way's
losses equal the floor's. The ``skeleton`` row is a bound for any FSDP whose parameters
are ``DTensor`` s stepped by that optimizer: most of its overhead is the optimizer's
``DTensor`` dispatch, which no engine controls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODES = ("floor", "skeleton", "hyperfsdp", "fsdp2")


def _skeleton(model, mesh):
    """Install the skeleton on ``model``; returns (its DTensor parameters, end-of-backward)."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor, Shard

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    units = [*model.layers, model]
    entries_per_unit = []
    for unit in units:
        entries = []
        for name, module in unit.named_modules():
            if unit is model and name.startswith("layers"):
                continue  # the blocks are units of their own
            for pname, full in list(module._parameters.items()):
                if full is None:
                    continue
                # world size 1: the shard is the whole tensor, in the same memory
                sharded = nn.Parameter(
                    DTensor.from_local(full.detach(), mesh, [Shard(0)], run_check=False)
                )
                module._parameters[pname] = sharded
                entries.append((module, pname, sharded, full))
        entries_per_unit.append(entries)

    for unit, entries in zip(units, entries_per_unit, strict=True):

        def to_full(entries=entries):
            for module, pname, _, full in entries:
                module._parameters[pname] = full

        def to_sharded(entries=entries):
            for module, pname, sharded, _ in entries:
                module._parameters[pname] = sharded

        def pre_forward(module, args, to_full=to_full):
            to_full()
            if len(args) == 1 and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                return (Identity.apply(args[0]),)
            return args

        def post_forward(module, args, out, to_full=to_full, to_sharded=to_sharded):
            to_sharded()
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: (to_full(), grad)[1])
            return out

        unit.register_forward_pre_hook(pre_forward)
        unit.register_forward_hook(post_forward)

    def end_of_backward():
        for entries in entries_per_unit:
            for module, pname, sharded, full in entries:
                module._parameters[pname] = sharded
                grad, full.grad = full.grad, None
                sharded.grad = DTensor(grad, sharded._spec, requires_grad=False)

    params = [e[2] for entries in entries_per_unit for e in entries]
    return params, end_of_backward


def _build(mode: str, spec, mesh):
    """``mode``'s model, optimizer and end-of-backward work (None but for the skeleton)."""
    import torch
    from hyperfsdp_bench.model import build_model

    model = build_model(spec.model, spec.seed)
    end_of_backward = None
    if mode == "skeleton":
        params, end_of_backward = _skeleton(model, mesh)
    else:
        if mode == "hyperfsdp":
            from hyperfsdp_core import fully_shard
        elif mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        if mode != "floor":
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
        params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.1)
    return model, opt, end_of_backward


def measure(steps: int, warmup: int, clock_name: str) -> dict:
    """Every way in this one process, a step of each in turn (the order rotating), so
    that the machine's drift hits them alike; per way, the times of every step."""
    import torch
    import torch.distributed as dist
    from hyperfsdp_bench.cases import Case
    from hyperfsdp_bench.model import make_batches
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    clock = time.thread_time if clock_name == "cpu" else time.perf_counter
    case = Case("host-overhead", 1, 64)
    spec = case.spec()
    batches = make_batches(spec.model, spec.seed, 0, 8)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            built = {mode: _build(mode, spec, mesh) for mode in MODES}
            out = {m: {"fwd_bwd": [], "optim": [], "losses": []} for m in MODES}
            for i in range(warmup + steps):
                tokens, targets = batches[i % len(batches)]
                k = i % len(MODES)
                for mode in MODES[k:] + MODES[:k]:
                    model, opt, end_of_backward = built[mode]
                    opt.zero_grad(set_to_none=True)
                    t0 = clock()
                    loss = model(tokens, targets)
                    loss.backward()
                    if end_of_backward is not None:
                        end_of_backward()
                    t1 = clock()
                    opt.step()
                    t2 = clock()
                    out[mode]["losses"].append(float(loss.detach()))
                    if i >= warmup:
                        out[mode]["fwd_bwd"].append(t1 - t0)
                        out[mode]["optim"].append(t2 - t1)
            return {"units": case.layers + 1, "modes": out}
        finally:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="host_overhead_bound", description=__doc__.split("\n\n")[0].strip()
    )
    p.add_argument("--steps", type=int, default=200, help="timed steps of each (default 200)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="this thread's CPU time (default; robust on a busy machine) or wall time",
    )
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    res = measure(args.steps, args.warmup, args.clock)
    units, modes = res["units"], res["modes"]
    med = {
        m: {k: statistics.median(modes[m][k]) * 1e3 for k in ("fwd_bwd", "optim")} for m in MODES
    }
    for m in MODES:
        med[m]["step"] = med[m]["fwd_bwd"] + med[m]["optim"]

    def over(m: str, key: str) -> float:
        """Per unit: ``m``'s median ``key`` time minus the floor's."""
        return (med[m][key] - med["floor"][key]) / units

    clock = "thread CPU time" if args.clock == "cpu" else "wall time"
    print(
        f"host-overhead model, world 1, {units} units; {args.steps} steps of each way, "
        f"interleaved in one process; medians of {clock}"
    )
    print(
        f"{'':10} {'fwd+bwd ms':>10} {'optim ms':>9} {'overhead ms/unit':>17} {'xFSDP2':>7}"
        f" {'engine ms/unit':>15} {'xFSDP2':>7} {'losses = floor':>15}"
    )
    floor_losses = modes["floor"]["losses"]
    for m in MODES:
        row = f"{m:10} {med[m]['fwd_bwd']:10.1f} {med[m]['optim']:9.1f}"
        if m != "floor":
            total, engine = over(m, "step"), over(m, "fwd_bwd")
            row += f" {total:17.3f} {total / over('fsdp2', 'step'):6.2f}x"
            row += f" {engine:15.3f} {engine / over('fsdp2', 'fwd_bwd'):6.2f}x"
            row += f" {modes[m]['losses'] == floor_losses!s:>15}"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
