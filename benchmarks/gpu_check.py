"""The prepared GPU check: hyperfsdp beside torch FSDP2 on one accelerator, one report file.

    make gpu-check                              # on a CUDA machine: installs offline, ~4-6 min
    python benchmarks/gpu_check.py --device cpu # the dry run: gloo, a tiny model, ~1-2 min

It needs only what a GPU image with torch has (torch, pluggy, attrs): it runs from the
checkout (the core and the offload plugin are put on ``sys.path``, and the plugin is
registered by hand when no entry point provides it). ``--install`` first tries
``pip install --no-deps --no-build-isolation --no-index -e . -e plugins/offload`` and
reports whether it worked. Transport plugins are kept off (``HYPERFSDP_PLUGINS_DISABLE``):
the check measures the core alone, what an accelerator runs.

Every case runs in a fresh subprocess with a timeout (clean peak-memory counters; one
failure or hang does not stop the rest); a global ``--budget`` skips what would not fit.
The cases:

a. ``real``: a real 1-rank process group (NCCL; gloo on CPU), a Llama-like model of about
   1B parameters in bf16 mixed precision (fp32 reduce), AdamW (fused on CUDA), with
   ``torch.use_deterministic_algorithms``: losses bit for bit (hyperfsdp vs FSDP2, and
   FSDP2 vs a second FSDP2 run for its own spread), step time, peak memory, bytes copied
   and allocations per step.
b. ``fake``: torch's fake process group simulating world 8 on the one device (collectives
   do nothing; each rank holds 1/8 and takes the all-gather path), even and uneven shapes:
   step time, peak memory, bytes copied and allocations per step, and from a profiled step
   how much of the side streams' kernel time overlapped the compute stream.
c. ``streams``: ``benchmarks/streams_cuda.py`` (``set_post_optim_event`` lets the next
   forward's copy-in start before work queued after the optimizer ends).
d. ``offload``: ``benchmarks/offload_cuda.py --small`` (CPU offload's pinned copies beside
   FSDP2's).
e. ``compiled``: ``torch.compile``d blocks (inductor; ``aot_eager`` on CPU) under both.

Bytes copied are counted by a dispatch mode over one extra step: the bytes written by
copy operators (``copy_``, dtype casts, concatenations, FSDP2's copy-in/copy-out ops).
Allocations are the profiler's allocation events over one step (the same method for both).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = "RESULT "
IMPLS = ("hyperfsdp", "fsdp2")

# model sizes: about 1B parameters on CUDA, tiny for the CPU dry run
SIZES = {
    "cuda": {
        "real": dict(vocab=32000, dim=2048, layers=16, heads=16, hidden=5632, batch=4, seq=2048),
        "fake": dict(vocab=32000, dim=2048, layers=16, heads=16, hidden=5632, batch=2, seq=2048),
        "fake-uneven": dict(
            vocab=32003, dim=2048, layers=16, heads=16, hidden=5630, batch=2, seq=2048
        ),
        "compiled": dict(vocab=8192, dim=1024, layers=4, heads=8, hidden=2816, batch=4, seq=1024),
    },
    "cpu": {
        "real": dict(vocab=128, dim=64, layers=2, heads=4, hidden=176, batch=2, seq=32),
        "fake": dict(vocab=128, dim=64, layers=2, heads=4, hidden=176, batch=2, seq=32),
        "fake-uneven": dict(vocab=131, dim=64, layers=2, heads=4, hidden=174, batch=2, seq=32),
        "compiled": dict(vocab=128, dim=64, layers=2, heads=4, hidden=176, batch=2, seq=32),
    },
}
STEPS = {"cuda": (3, 8), "cpu": (1, 3)}  # (warm-up, timed)

COPY_OPS = {
    "aten.copy_.default",
    "aten._to_copy.default",
    "aten._foreach_copy_.default",
    "aten.split_with_sizes_copy.default",
    "aten.split_with_sizes_copy.out",
    "aten.cat.default",
    "aten.cat.out",
    "aten.stack.default",
    "aten.clone.default",
    "aten.constant_pad_nd.default",
    "aten.chunk_cat.default",
    "aten.chunk_cat.out",
    "fsdp.all_gather_copy_in.default",
    "fsdp.split_with_sizes_copy.default",
    "fsdp.chunk_cat.default",
}


# -- inside a case's process -----------------------------------------------------------------------


def _setup_paths() -> None:
    for path in (ROOT, ROOT / "plugins" / "offload", ROOT / "benchmarks"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def _init_group(device: str, world: int) -> str:
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
    if world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        return "fake"
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return backend


def _build(spec: dict, impl: str, device: str, world: int, compiled: bool):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from hyperfsdp_core.testing.reference import Transformer

    if impl == "hyperfsdp":
        from hyperfsdp_core import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(
            vocab=spec["vocab"],
            dim=spec["dim"],
            n_layers=spec["layers"],
            n_heads=spec["heads"],
            hidden=spec["hidden"],
        )
    mesh = init_device_mesh(device, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        if compiled:
            block.compile(backend="inductor" if device == "cuda" else "aot_eager")
        # the last block's parameters are needed at once by the backward: keep them
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    _init_weights(model, spec)
    fused = {"fused": True} if device == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    return model, opt


def _init_weights(model, spec: dict) -> None:
    """The same values on every run, whatever the implementation: a per-parameter seed."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.named_parameters())):
            local = p.to_local() if isinstance(p, DTensor) else p
            full = torch.empty(p.shape, dtype=p.dtype, device=local.device)
            g = torch.Generator(device=local.device).manual_seed(1000 + i)
            if name.endswith("norm.weight"):
                full.fill_(1.0)
            else:
                full.normal_(0.0, spec["dim"] ** -0.5, generator=g)
            if isinstance(p, DTensor):
                from torch.distributed.tensor import distribute_tensor

                full = distribute_tensor(full, p.device_mesh, p.placements).to_local()
            local.copy_(full)


def _batch(spec: dict, device: str, step: int):
    import torch

    g = torch.Generator(device=device).manual_seed(100 + step)
    tokens = torch.randint(
        0, spec["vocab"], (spec["batch"], spec["seq"] + 1), device=device, generator=g
    )
    return tokens[:, :-1], tokens[:, 1:]


class _CopyCounter:
    """A dispatch mode adding up the bytes written by copy operators, per operator."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = str(func)
                if name in COPY_OPS or name.startswith("fsdp."):
                    kwargs = kwargs or {}
                    if "out" in kwargs:  # out= variants return nothing useful
                        written = kwargs["out"]
                    elif name.split(".")[1].endswith("_"):  # in place: what it writes into
                        written = args[0]
                    else:
                        written = out
                    counter.add(name, written)
                return out

        self.mode = Mode()
        self.bytes: dict[str, int] = {}

    def add(self, name: str, out) -> None:
        import torch

        tensors = (
            [out]
            if isinstance(out, torch.Tensor)
            else [t for t in (out or []) if isinstance(t, torch.Tensor)]
        )
        n = sum(t.numel() * t.element_size() for t in tensors)
        self.bytes[name] = self.bytes.get(name, 0) + n


def case_train(spec: dict, args: dict) -> dict:
    import torch
    import torch.nn.functional as F

    device, world, impl = args["device"], args["world"], args["impl"]
    if args["deterministic"]:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if device == "cuda":  # the fused attention kernels' backward is not deterministic
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
    _init_group(device, world)
    model, opt = _build(spec, impl, device, world, args["compiled"])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step(i: int) -> float:
        x, y = _batch(spec, device, i)
        out = model(x)
        loss = F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    warm, timed = STEPS[device]
    losses = [step(i) for i in range(warm)]
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        allocs0 = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    times = []
    for i in range(warm, warm + timed):
        sync()
        t0 = time.perf_counter()
        losses.append(step(i))
        sync()
        times.append(time.perf_counter() - t0)
    res = {
        "losses": [float(v) for v in losses],
        "losses_hex": [float(v).hex() for v in losses],
        "step_ms": 1e3 * statistics.median(times),
        "step_ms_all": [round(1e3 * t, 3) for t in times],
        "params": sum(p.numel() for p in model.parameters()),
    }
    if device == "cuda":
        stats = torch.cuda.memory_stats()
        res["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        res["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        res["allocator_allocs_per_step"] = (
            stats.get("allocation.all.allocated", 0) - allocs0
        ) / timed
    counter = _CopyCounter()
    with counter.mode:
        step(warm + timed)
    res["copied_bytes_per_step"] = sum(counter.bytes.values())
    res["copied_bytes_by_op"] = counter.bytes
    res.update(_profiled(step, warm + timed + 1, device))
    return res


def _profiled(step, i: int, device: str) -> dict:
    """One profiled step: allocations (the trace's allocation events of the step's
    device) and on CUDA how much the side streams' kernels overlapped the compute stream."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        step(i)
        if device == "cuda":
            torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    device_type = 1 if device == "cuda" else 0
    allocs = [
        e["args"]["Bytes"]
        for e in events
        if e.get("name") == "[memory]"
        and e["args"].get("Device Type") == device_type
        and e["args"].get("Bytes", 0) > 0
    ]
    out = {"allocations_per_step": len(allocs), "allocated_bytes_per_step": sum(allocs)}
    if device == "cuda":
        out.update(_stream_overlap(events))
    return out


def _stream_overlap(events: list) -> dict:
    kernels = [e for e in events if e.get("cat") == "kernel" and "stream" in e.get("args", {})]
    if not kernels:
        return {"overlap": "no kernels in the trace"}
    by_stream: dict = {}
    for k in kernels:
        by_stream.setdefault(k["args"]["stream"], []).append((k["ts"], k["ts"] + k["dur"]))
    from offload_cuda import _overlap, _union  # the same interval arithmetic, one copy

    compute = max(by_stream, key=lambda s: sum(b - a for a, b in by_stream[s]))
    union = _union(by_stream[compute])
    side = {}
    for stream, spans in by_stream.items():
        if stream == compute:
            continue
        side[str(stream)] = {
            "kernels": len(spans),
            "busy_ms": sum(b - a for a, b in spans) / 1e3,
            "overlapped_ms": _overlap(spans, union) / 1e3,
        }
    return {"compute_stream": str(compute), "side_streams": side}


def _case_main(raw: str) -> int:
    _setup_paths()
    args = json.loads(raw)
    spec = SIZES[args["device"]][args["size"]]
    try:
        res = case_train(spec, args)
    except Exception as exc:  # reported, not raised: the driver goes on with the next case
        import traceback

        res = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    print(RESULT + json.dumps(res), flush=True)
    return 0


# -- the driver ------------------------------------------------------------------------------------


class Driver:
    def __init__(self, device: str, budget: float, report: Path) -> None:
        self.device = device
        self.deadline = time.monotonic() + budget
        self.report = report
        self.results: dict[str, dict] = {}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
        disabled = [n for n in os.environ.get("HYPERFSDP_PLUGINS_DISABLE", "").split(",") if n]
        self.env["HYPERFSDP_PLUGINS_DISABLE"] = ",".join(sorted({*disabled, "shm", "qcomm"}))

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, cmd: list[str], timeout: float) -> dict:
        timeout = min(timeout, self.left())
        if timeout < 15:
            res = {"error": "skipped: the check's time budget is spent"}
        else:
            t0 = time.monotonic()
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=ROOT
                )
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
                if lines:
                    res = json.loads(lines[-1][len(RESULT) :])
                else:
                    res = {"rc": proc.returncode, "output": (proc.stdout + proc.stderr)[-6000:]}
                    if proc.returncode:
                        res["error"] = f"exit status {proc.returncode}"
            except subprocess.TimeoutExpired as exc:
                out = (exc.stdout or "") + (exc.stderr or "")
                out = out.decode() if isinstance(out, bytes) else out
                res = {"error": f"timed out after {timeout:.0f} s", "output": out[-4000:]}
            res["wall_s"] = round(time.monotonic() - t0, 1)
        self.results[name] = res
        print(
            f"  {name}: {'ERROR ' + res['error'] if 'error' in res else 'ok'} ({res.get('wall_s', 0)} s)",
            flush=True,
        )
        self.write()
        return res

    def train(self, name: str, impl: str, size: str, world: int, **kw) -> dict:
        args = dict(
            device=self.device,
            impl=impl,
            size=size,
            world=world,
            deterministic=kw.get("deterministic", False),
            compiled=kw.get("compiled", False),
        )
        cmd = [sys.executable, __file__, "--case", json.dumps(args)]
        return self.run(name, cmd, kw.get("timeout", 180))

    def script(self, name: str, rel: str, *extra: str, timeout: float = 150) -> dict:
        return self.run(name, [sys.executable, str(ROOT / rel), *extra], timeout)

    def write(self) -> None:
        self.report.parent.mkdir(parents=True, exist_ok=True)
        self.report.write_text(render(self.device, self.results))


def install() -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-e",
        str(ROOT),
        "-e",
        str(ROOT / "plugins" / "offload"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return {
        "command": " ".join(cmd[1:]),
        "rc": proc.returncode,
        "output": (proc.stdout + proc.stderr)[-2000:],
    }


def checks(results: dict) -> list[tuple[str, bool, str]]:
    """What the report asserts, as (name, passed, detail)."""
    out = []

    def pair(a: str, b: str, what: str) -> None:
        ra, rb = results.get(a, {}), results.get(b, {})
        if not ra and not rb:
            return  # not asked for
        if "losses_hex" not in ra or "losses_hex" not in rb:
            out.append((what, False, "not run or failed"))
            return
        same = ra["losses_hex"] == rb["losses_hex"]
        gap = max(abs(x - y) for x, y in zip(ra["losses"], rb["losses"]))
        out.append((what, same, f"largest loss gap {gap:.3g}"))

    pair("real/fsdp2", "real/fsdp2-again", "FSDP2 against itself: losses bit for bit")
    pair("real/hyperfsdp", "real/fsdp2", "hyperfsdp against FSDP2: losses bit for bit")
    pair("compiled/hyperfsdp", "compiled/fsdp2", "compiled blocks: losses bit for bit")
    for size in ("fake", "fake-uneven"):
        h, f = results.get(f"{size}/hyperfsdp", {}), results.get(f"{size}/fsdp2", {})
        if "copied_bytes_per_step" in h and "copied_bytes_per_step" in f:
            out.append(
                (
                    f"{size}: hyperfsdp copies fewer bytes per step",
                    h["copied_bytes_per_step"] < f["copied_bytes_per_step"],
                    f"{h['copied_bytes_per_step'] / 2**20:.1f} vs {f['copied_bytes_per_step'] / 2**20:.1f} MiB",
                ),
            )
    for name in ("streams", "offload"):
        if name in results:
            r = results[name]
            out.append((name, "error" not in r and r.get("rc", 0) == 0, r.get("error", "")))
    return out


def _ratio(a, b) -> str:
    return (
        f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"
    )


def _fmt(v, f="{:.2f}") -> str:
    return f.format(v) if isinstance(v, (int, float)) else "-"


def render(device: str, results: dict) -> str:
    import torch

    lines = [
        f"# hyperfsdp GPU check ({device})",
        "",
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        + (
            torch.cuda.get_device_name(0)
            if device == "cuda" and torch.cuda.is_available()
            else platform.processor() or "cpu"
        ),
        "",
        "| case | impl | step ms | peak alloc GiB | copied MiB/step | allocations/step | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "/" not in name:
            continue
        case, impl = name.split("/", 1)
        lines.append(
            f"| {case} | {impl} | {_fmt(r.get('step_ms'), '{:.1f}')} | {_fmt(r.get('peak_allocated_gib'))} "
            f"| {_fmt(r.get('copied_bytes_per_step', 0) / 2**20 if 'copied_bytes_per_step' in r else None, '{:.1f}')} "
            f"| {r.get('allocations_per_step', '-')} | {r.get('error', '')} |"
        )
    lines += ["", "Ratios hyperfsdp / FSDP2:", ""]
    for case in ("real", "fake", "fake-uneven", "compiled"):
        h, f = results.get(f"{case}/hyperfsdp", {}), results.get(f"{case}/fsdp2", {})
        if h and f:
            lines.append(
                f"- {case}: step {_ratio(h.get('step_ms'), f.get('step_ms'))}, "
                f"peak memory {_ratio(h.get('peak_allocated_gib'), f.get('peak_allocated_gib'))}, "
                f"bytes copied {_ratio(h.get('copied_bytes_per_step'), f.get('copied_bytes_per_step'))}, "
                f"allocations {_ratio(h.get('allocations_per_step'), f.get('allocations_per_step'))}"
            )
    lines += ["", "Checks:", ""]
    for what, ok, detail in checks(results):
        lines.append(f"- [{'x' if ok else ' '}] {what}" + (f" ({detail})" if detail else ""))
    lines += [
        "",
        "Raw results:",
        "",
        "```json",
        json.dumps(results, indent=1, default=str),
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--report", type=Path, default=ROOT / "gpu-check-report.md")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for all cases")
    p.add_argument("--install", action="store_true", help="pip install the checkout offline first")
    p.add_argument(
        "--only",
        action="append",
        help="run these cases only (real, fake, streams, offload, compiled)",
    )
    p.add_argument("--case", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.case:
        return _case_main(a.case)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --device cpu for the dry run")
        return 2
    d = Driver(a.device, a.budget, a.report)
    if a.install:
        d.results["install"] = install()
    want = set(a.only or ("real", "fake", "streams", "offload", "compiled"))
    print(f"gpu_check on {a.device}: report {a.report}", flush=True)
    if "real" in want:
        for name, impl in (
            ("hyperfsdp", "hyperfsdp"),
            ("fsdp2", "fsdp2"),
            ("fsdp2-again", "fsdp2"),
        ):
            d.train(f"real/{name}", impl, "real", 1, deterministic=True)
    if "fake" in want:
        for size in ("fake", "fake-uneven"):
            for impl in IMPLS:
                d.train(f"{size}/{impl}", impl, size, 8)
    if "streams" in want and a.device == "cuda":
        d.script("streams", "benchmarks/streams_cuda.py", timeout=90)
    if "offload" in want and a.device == "cuda":
        d.script("offload", "benchmarks/offload_cuda.py", "--small", timeout=150)
    if "compiled" in want:
        for impl in IMPLS:
            d.train(
                f"compiled/{impl}",
                impl,
                "compiled",
                1,
                deterministic=True,
                compiled=True,
                timeout=240,
            )
    d.write()
    failed = [what for what, ok, _ in checks(d.results) if not ok]
    errors = [n for n, r in d.results.items() if "error" in r]
    print(f"gpu_check: report written to {a.report}")
    for what in failed:
        print(f"  check failed: {what}")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
