"""CPU offload on a CUDA machine: hyperfsdp (``hyperfsdp-offload``) beside torch FSDP2.

    python benchmarks/offload_cuda.py            # about 1-2 minutes on one H200
    python benchmarks/offload_cuda.py --small    # a smaller model, for a quick look

Self-contained: runs from a checkout without installing anything but torch, pluggy and
attrs (the checkout and its offload plugin are put on ``sys.path``; the plugin is
registered by hand when no entry point provides it). Every case runs in a fresh
subprocess (clean peak-memory counters, one failure does not stop the rest). It prints:

1. **checks** (a real 1-rank process group): training with ``CPUOffloadPolicy`` matches
   the unsharded reference and hyperfsdp without offload; parameters, gradients and
   optimizer state are host tensors, the sharded storage is pinned; host/device copy
   bandwidths of this machine.
2. **a table**, per implementation and offload setting: forward+backward time (until the
   gradients are usable by the optimizer: for offload, on the host), optimizer step time,
   peak and at-rest device memory, the host<->device copy time per step measured by the
   profiler, how much of it overlapped compute kernels (profiler), and how much of it the
   step time hides (``1 - (t_offload - t_no_offload) / copy time``).

The table shards over a *simulated* world (``--world``, default 2) on the one GPU: a fake
process group whose collectives do nothing, so each rank-0 process holds 1/world of the
model and takes the all-gather path, and the figures isolate copies and compute from
communication. Values computed there are meaningless; the checks use a real process group.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = "RESULT "
DEVICE = "cuda"


# -- setup shared by every case -----------------------------------------------------------------


def _import_hyperfsdp():
    for path in (ROOT, ROOT / "plugins" / "offload"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import hyperfsdp_offload.plugin as offload_plugin

    from hyperfsdp_core import get_plugin_manager

    pm = get_plugin_manager()
    if pm.get_plugin("offload") is None:  # run from a checkout: no entry point installed
        pm.register(offload_plugin, name="offload")
    return offload_plugin


def _init_process_group(world: int) -> str:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    if world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        return "fake"
    for backend in ("nccl", "gloo"):
        try:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            return backend
        except Exception:  # try the next backend
            continue
    raise RuntimeError("no process group backend could be initialized")


def _model(spec: dict):
    import torch

    from hyperfsdp_core.testing.reference import Transformer

    torch.manual_seed(0)
    return Transformer(
        vocab=spec["vocab"],
        dim=spec["dim"],
        n_layers=spec["layers"],
        n_heads=spec["heads"],
        hidden=spec["hidden"],
    )


def _shard(model, spec: dict, mesh):
    import torch

    mixed = spec["dtype"] == "bf16"
    if spec["impl"] == "hyperfsdp":
        from hyperfsdp_core import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )
    else:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )
    offload = {
        "none": OffloadPolicy(),
        "pinned": CPUOffloadPolicy(pin_memory=True),
        "pageable": CPUOffloadPolicy(pin_memory=False),
    }[spec["offload"]]
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed
        else MixedPrecisionPolicy()
    )
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return model


def _batch(spec: dict, step: int):
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(100 + step)
    tokens = torch.randint(
        0, spec["vocab"], (spec["batch"], spec["seq"] + 1), device=DEVICE, generator=g
    )
    return tokens[:, :-1], tokens[:, 1:]


def _loss(out, target):
    import torch.nn.functional as F

    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _where(model, opt) -> dict:
    import torch

    def kinds(tensors):
        return sorted({_local(t).device.type for t in tensors})

    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    params = list(model.parameters())
    return {
        "params": kinds(params),
        "grads": kinds(p.grad for p in params if p.grad is not None),
        "optimizer_state": kinds(t for t in state if t.dim() > 0),
        "params_pinned": sorted({_local(p).is_pinned() for p in params}),
    }


# -- the overlap of copies with compute, from a profiler trace -----------------------------------


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _overlap(intervals, union) -> float:
    total = 0.0
    for start, end in intervals:
        for u_start, u_end in union:
            if u_start >= end:
                break
            total += max(0.0, min(end, u_end) - max(start, u_start))
    return total


def _copy_overlap(run_step) -> dict:
    """Profile one step: host<->device copy time on the device, and the part of it that
    ran while a compute kernel ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_step()
    copies, kernels = [], []
    for e in prof.events():
        if "cuda" not in str(getattr(e, "device_type", "")).lower():
            continue
        interval = (e.time_range.start, e.time_range.end)  # microseconds
        name = e.name
        if name.startswith(("Memcpy HtoD", "Memcpy DtoH")):
            copies.append(interval)
        elif not name.startswith(("Memcpy", "Memset")):
            kernels.append(interval)
    busy = sum(end - start for start, end in copies)
    overlapped = _overlap(copies, _union(kernels))
    return {
        "copy_ms": busy / 1e3,
        "overlap_pct": 100.0 * overlapped / busy if busy else None,
        "copies": len(copies),
    }


# -- cases (each in its own process) -------------------------------------------------------------


def case_perf(spec: dict) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    if spec["impl"] == "hyperfsdp":
        _import_hyperfsdp()
    backend = _init_process_group(spec["world"])
    mesh = init_device_mesh(DEVICE, (spec["world"],))
    model = _shard(_model(spec), spec, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = {"fwd_bwd": [], "optim": []}

    def fwd_bwd(step):
        x, y = _batch(spec, step)
        _loss(model(x), y).backward()

    for step in range(spec["warmup"]):
        fwd_bwd(step)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for step in range(spec["steps"]):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd_bwd(step)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        where = _where(model, opt) if step == spec["steps"] - 1 else None
        opt.zero_grad()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        times["fwd_bwd"].append(t1 - t0)
        times["optim"].append(t2 - t1)
    peak = torch.cuda.max_memory_allocated()
    at_rest = torch.cuda.memory_allocated()

    def profiled():
        fwd_bwd(0)
        torch.cuda.synchronize()

    try:
        profile = _copy_overlap(profiled)
    except Exception as exc:  # report it, keep the timings
        profile = {"error": f"{type(exc).__name__}: {exc}"}
    opt.zero_grad()

    def median(values):
        return sorted(values)[len(values) // 2] * 1e3

    return {
        "backend": backend,
        "fwd_bwd_ms": median(times["fwd_bwd"]),
        "optim_ms": median(times["optim"]),
        "peak_mib": peak / 2**20,
        "at_rest_mib": at_rest / 2**20,
        "where": where,
        "profile": profile,
    }


def _bandwidth() -> dict:
    import torch

    nbytes = 256 * 2**20
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - t0) / 5
            out[f"{name}_{'pinned' if pinned else 'pageable'}_gbs"] = nbytes / seconds / 1e9
    return out


def case_checks(spec: dict) -> dict:
    """Real 1-rank group: offload against no offload and the unsharded reference."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    _import_hyperfsdp()
    backend = _init_process_group(1)
    mesh = init_device_mesh(DEVICE, (1,))
    results = {"backend": backend, "bandwidth": _bandwidth(), "runs": {}}
    small = dict(spec, vocab=1000, dim=128, layers=3, heads=4, hidden=352, batch=4, seq=64)
    for dtype in ("fp32", "bf16"):
        # bf16 compute: compared with hyperfsdp without offload only
        reference = _model(small).to(DEVICE) if dtype == "fp32" else None
        models = {}
        for offload in ("none", "pinned", "pageable"):
            models[offload] = _shard(
                _model(small), dict(small, impl="hyperfsdp", offload=offload, dtype=dtype), mesh
            )

        # SGD with momentum: state on the host, and parameter gaps that track gradient gaps
        # (the optimizer runs on the host with offload, on the device without: not bitwise)
        def sgd(params):
            return torch.optim.SGD(params, lr=1e-2, momentum=0.9)

        opts = {k: sgd(m.parameters()) for k, m in models.items()}
        ref_opt = sgd(reference.parameters()) if reference is not None else None
        losses = {k: [] for k in [*models, "reference"]}
        for step in range(4):
            x, y = _batch(small, step)
            # the second microbatch of step 1 accumulates into host gradients
            micro = 2 if step == 1 else 1
            for i in range(micro):
                for name, model in models.items():
                    model.set_is_last_backward(i == micro - 1)
                    loss = _loss(model(x), y) / micro
                    loss.backward()
                    losses[name].append(loss.item())
                if reference is not None:
                    loss = _loss(reference(x), y) / micro
                    loss.backward()
                    losses["reference"].append(loss.item())
            where = {k: _where(m, opts[k]) for k, m in models.items()}
            for opt in [*opts.values(), *([ref_opt] if ref_opt else [])]:
                opt.step()
                opt.zero_grad()
        params = {k: {n: _local(p).detach().cpu() for n, p in m.named_parameters()}
                  for k, m in models.items()}  # fmt: skip
        diffs = {}
        for k in ("pinned", "pageable"):
            diffs[f"{k}_vs_no_offload"] = max(
                (params[k][n] - params["none"][n]).abs().max().item() for n in params["none"]
            )
        if reference is not None:
            ref_params = dict(copy.deepcopy(reference).cpu().named_parameters())
            diffs["pinned_vs_reference"] = max(
                (params["pinned"][n] - ref_params[n].detach()).abs().max().item()
                for n in params["none"]
            )
        plan = {str(row.column("storage")) for row in models["pinned"].sharding_plan()}
        results["runs"][dtype] = {
            "diffs": diffs,
            "losses": {k: [round(v, 6) for v in vs] for k, vs in losses.items()},
            "where": where,
            "storage_column": sorted(plan),
        }
    return results


CASES = {"perf": case_perf, "checks": case_checks}


# -- driver --------------------------------------------------------------------------------------


def _run_case(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
    return {"error": f"exit code {proc.returncode}", "tail": tail}


def _fmt(value, spec="{:.1f}") -> str:
    return "-" if value is None else spec.format(value)


def _print_checks(res: dict) -> bool:
    if "error" in res:
        print(f"  FAILED to run: {res['error']}")
        for line in res.get("tail", []):
            print(f"    {line}")
        return False
    bw = res["bandwidth"]
    print(
        f"  copy bandwidth (GB/s): H2D pinned {bw['h2d_pinned_gbs']:.1f}, pageable "
        f"{bw['h2d_pageable_gbs']:.1f}; D2H pinned {bw['d2h_pinned_gbs']:.1f}, pageable "
        f"{bw['d2h_pageable_gbs']:.1f}"
    )
    ok = True
    for dtype, run in res["runs"].items():
        where = run["where"]
        host = all(
            w[k] == ["cpu"]
            for name, w in where.items()
            if name != "none"
            for k in ("params", "grads", "optimizer_state")
        )
        pinned = where["pinned"]["params_pinned"] == [True]
        tol = 1e-5 if dtype == "fp32" else 1e-3  # bf16: a rounding flip of a cast parameter
        close = all(v <= tol for k, v in run["diffs"].items() if "no_offload" in k)
        ref = run["diffs"].get("pinned_vs_reference")
        ref_ok = ref is None or ref < 1e-4
        column = run["storage_column"] == ["host, pinned"]
        passed = host and pinned and close and ref_ok and column
        ok &= passed
        diffs = ", ".join(f"{k} {v:.2e}" for k, v in run["diffs"].items())
        print(
            f"  {dtype}: {'PASS' if passed else 'FAIL'}  max |param diff|: {diffs}; offloaded "
            f"params/grads/optimizer state on the host: {host}; storage pinned: {pinned}; "
            f"sharding_plan storage column: {run['storage_column']}"
        )
        if not passed:
            print(f"    where: {where}")
            print(f"    losses: {run['losses']}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="simulated shard world (default 2)")
    parser.add_argument("--small", action="store_true", help="a smaller model (quick look)")
    parser.add_argument("--fp32", action="store_true", help="fp32 compute (default: bf16 mixed)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--impl", action="append", choices=["hyperfsdp", "fsdp2"])
    parser.add_argument("--case-timeout", type=float, default=240.0)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.case:  # a subprocess running one case
        spec = json.loads(args.case)
        result = CASES[spec["kind"]](spec)
        print(RESULT + json.dumps(result), flush=True)
        return 0

    import torch

    if not torch.cuda.is_available():
        print(
            "offload_cuda.py measures host<->device copies and device memory: it needs a CUDA "
            "GPU, and torch.cuda.is_available() is False here. Nothing was run.",
            file=sys.stderr,
        )
        return 2
    model = (
        {"vocab": 8192, "dim": 512, "layers": 4, "heads": 8, "hidden": 1408, "batch": 4, "seq": 512}
        if args.small
        else {"vocab": 32000, "dim": 1024, "layers": 8, "heads": 8, "hidden": 2816, "batch": 8,
              "seq": 1024}
    )  # fmt: skip
    base = dict(model, world=args.world, steps=args.steps, warmup=args.warmup,
                dtype="fp32" if args.fp32 else "bf16")  # fmt: skip
    started = time.perf_counter()
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}; hyperfsdp from {ROOT}",
        flush=True,
    )

    print(
        "\n== checks (real 1-rank process group, small model, SGD with momentum, 4 steps, "
        "two microbatches in step 1) ==",
        flush=True,
    )
    checks_ok = _print_checks(_run_case(dict(base, kind="checks"), args.case_timeout))

    n_params = sum(p.numel() for p in _model(base).parameters())
    print(
        f"\n== {base['dtype']} training, {n_params / 1e6:.0f}M parameters, simulated world "
        f"{args.world} (1/{args.world} of the model per rank), batch {base['batch']} x "
        f"{base['seq']} tokens, median of {args.steps} steps ==",
        flush=True,
    )
    header = (
        f"{'impl':<10} {'offload':<9} {'fwd+bwd ms':>10} {'optim ms':>9} {'peak MiB':>9} "
        f"{'rest MiB':>9} {'copy ms':>8} {'overlap%':>8} {'hidden%':>8}"
    )
    print(header + "\n" + "-" * len(header), flush=True)
    impls = args.impl or ["hyperfsdp", "fsdp2"]
    results = {}
    for impl in impls:
        for offload in ("none", "pinned"):
            res = _run_case(dict(base, kind="perf", impl=impl, offload=offload), args.case_timeout)
            results[(impl, offload)] = res
            if "error" in res:
                print(f"{impl:<10} {offload:<9} error: {res['error']}", flush=True)
                for line in res.get("tail", []):
                    print(f"    {line}", flush=True)
                continue
            prof = res["profile"]
            hidden = None
            baseline = results.get((impl, "none"), {})
            if offload != "none" and "fwd_bwd_ms" in baseline and prof.get("copy_ms"):
                exposed = res["fwd_bwd_ms"] - baseline["fwd_bwd_ms"]
                hidden = 100.0 * max(0.0, min(1.0, 1.0 - exposed / prof["copy_ms"]))
            print(
                f"{impl:<10} {offload:<9} {res['fwd_bwd_ms']:>10.1f} {res['optim_ms']:>9.1f} "
                f"{res['peak_mib']:>9.0f} {res['at_rest_mib']:>9.0f} "
                f"{_fmt(prof.get('copy_ms')):>8} {_fmt(prof.get('overlap_pct')):>8} "
                f"{_fmt(hidden):>8}",
                flush=True,
            )
            if "error" in prof:
                print(f"    profiler: {prof['error']}", flush=True)
            if offload != "none":
                print(f"    where after step(): {res['where']}", flush=True)
    print(
        "\nfwd+bwd: until backward returns and the device is idle (offload: gradients complete "
        "on the host). copy ms: host<->device copies in one profiled fwd+bwd; overlap%: their "
        "part that ran while a compute kernel ran; hidden%: 1 - (fwd+bwd with offload - "
        "without) / copy ms. peak/rest MiB: torch.cuda.max_memory_allocated over the timed "
        "steps / memory_allocated after them.",
    )
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)
    failed = not checks_ok or any("error" in r for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
