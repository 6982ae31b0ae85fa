"""Profile one rank's training steps (cProfile) for hyperfsdp and FSDP2 on one case.

``python benchmarks/profile_step.py [--config even] [--world-size 2] [--layers 8] [--steps 10]``
writes ``benchmarks/results/profile-<impl>-rank<r>.prof`` and prints, per
implementation, where rank 0's time went (own time by source area, and the
hottest functions), so the two engines can be compared line by line.
"""

from __future__ import annotations

import argparse
import pstats
import time
from collections import defaultdict
from pathlib import Path

from .cases import Case
from .cli import results_dir
from .impls import needs_process_group
from .launch import RankPool

#: (area, substring of the profiled function's file or name); first match wins.
AREAS = (
    ("collective wait", "method 'wait' of"),
    ("hyperfsdp engine (Python)", "hyperfsdp_core"),
    ("FSDP2 engine (Python)", "torch/distributed/fsdp"),
    ("DTensor (Python)", "torch/distributed/tensor"),
    ("c10d issue (Python+C++)", "distributed_c10d"),
    ("c10d issue (Python+C++)", "torch._C._distributed_c10d"),
    ("bench harness", "hyperfsdp_bench"),
    ("optimizer (Python+kernels)", "torch/optim"),
    ("autograd backward (C++ kernels)", "run_backward"),
    ("autograd glue (Python)", "torch/autograd"),
    ("module call (Python)", "torch/nn/modules/module.py"),
    ("pytree (Python)", "torch/utils/_pytree"),
)


def area_of(func: tuple[str, int, str]) -> str:
    filename, _, name = func
    text = f"{filename}:{name}"
    for area, needle in AREAS:
        if needle in text:
            return area
    if filename == "~":
        if "torch" in name or "method" in name:
            return "torch ops / other builtins (C++)"
        return "other builtins"
    if "torch/" in filename:
        return "torch other (Python)"
    return "other Python"


def breakdown(path: str) -> tuple[dict[str, float], float, list]:
    stats = pstats.Stats(path)
    areas: dict[str, float] = defaultdict(float)
    rows = []
    for func, (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        areas[area_of(func)] += tt
        rows.append((tt, ct, nc, func))
    total = sum(areas.values())
    rows.sort(key=lambda r: -r[0])
    return dict(areas), total, rows


def _fmt_func(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    if filename == "~":
        return name
    short = filename
    for marker in ("site-packages/", "/work/main/"):
        if marker in short:
            short = short.split(marker, 1)[1]
    return f"{short}:{line}({name})"


def report(paths: dict[str, str], steps: int, top: int = 25) -> str:
    out = []
    parsed = {impl: breakdown(p) for impl, p in paths.items()}
    names = sorted({a for areas, _, _ in parsed.values() for a in areas})
    impls = list(parsed)
    out.append(
        "own time per step on rank 0, ms (cProfile; its overhead inflates Python-heavy areas)"
    )
    header = f"{'area':38s}" + "".join(f"{i:>14s}" for i in impls)
    out.append(header)
    out.append("-" * len(header))
    for area in sorted(names, key=lambda a: -max(parsed[i][0].get(a, 0.0) for i in impls)):
        out.append(
            f"{area:38s}"
            + "".join(f"{parsed[i][0].get(area, 0.0) / steps * 1e3:14.1f}" for i in impls)
        )
    out.append(f"{'total':38s}" + "".join(f"{parsed[i][1] / steps * 1e3:14.1f}" for i in impls))
    for impl in impls:
        _, _, rows = parsed[impl]
        out.append("")
        out.append(
            f"{impl}: top {top} functions by own time (ms/step own, ms/step cumulative, calls/step)"
        )
        for tt, ct, nc, func in rows[:top]:
            out.append(
                f"  {tt / steps * 1e3:8.2f} {ct / steps * 1e3:8.2f} {nc / steps:8.1f}  {_fmt_func(func)}"
            )
    return "\n".join(out)


def engine_functions(path: str, needle: str, steps: int, top: int = 30) -> str:
    """Cumulative time of one engine's own functions (where its per-step Python goes)."""
    stats = pstats.Stats(path)
    rows = [
        (ct, tt, nc, func)
        for func, (_cc, nc, tt, ct, _c) in stats.stats.items()  # type: ignore[attr-defined]
        if needle in func[0]
    ]
    rows.sort(key=lambda r: -r[0])
    lines = [f"{needle}: cumulative ms/step, own ms/step, calls/step"]
    for ct, tt, nc, func in rows[:top]:
        lines.append(
            f"  {ct / steps * 1e3:8.2f} {tt / steps * 1e3:8.2f} {nc / steps:8.1f}  {_fmt_func(func)}"
        )
    return "\n".join(lines)


ENGINE_FILES = {"hyperfsdp": "hyperfsdp_core/", "fsdp2": "torch/distributed/fsdp/"}


def pyspy_summary(path: str, impl: str, top: int = 20) -> str:
    """Summarise a ``py-spy record --format raw --idle`` file of one rank.

    Each sample is charged to the innermost engine frame and its engine caller
    (``caller > frame``), so a collective wait shows which step of the engine
    waited; samples idling in the benchmark's command pipe (between segments) are
    left out; samples without an engine frame are model/autograd/optimizer work.
    """
    needle = ENGINE_FILES.get(impl, impl)
    by_engine: dict[str, int] = defaultdict(int)
    by_leaf: dict[str, int] = defaultdict(int)
    total = in_engine = 0

    def short(frame: str) -> str:
        name, _, where = frame.partition(" (")
        return f"{name} ({where.rsplit('/', 1)[-1]}"

    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if "Connection._recv" in frames[-1] or "connection.py" in frames[-1]:
            continue  # idle between benchmark commands
        n = int(count)
        total += n
        by_leaf[frames[-1]] += n
        engine = [f for f in frames if needle in f]
        if engine:
            in_engine += n
            key = " > ".join(short(f) for f in engine[-2:])
            by_engine[key] += n
    if not total:
        return f"{impl}: no samples"
    lines = [
        f"{impl}: {total} samples while stepping; {100 * in_engine / total:.1f}% under an engine "
        f"frame ({needle}), charged to the innermost two:"
    ]
    for key, n in sorted(by_engine.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {100 * n / total:6.2f}%  {key}")
    lines.append(f"{impl}: top leaf frames")
    for frame, n in sorted(by_leaf.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {100 * n / total:6.2f}%  {frame}")
    return "\n".join(lines)


def _pyspy(pool: RankPool, steps: int, out: Path, impl: str) -> str | None:
    import shutil
    import signal
    import subprocess
    import sys

    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        print("py-spy not found (pip install py-spy); skipping")
        return None
    pid = pool.call("pid")[0]
    path = out / f"pyspy-{impl}-rank0.txt"
    proc = subprocess.Popen(
        [
            exe,
            "record",
            "--pid",
            str(pid),
            "--format",
            "raw",
            "--idle",
            "--nonblocking",
            "--rate",
            "200",
            "--output",
            str(path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(2.0)  # let py-spy attach
    pool.call("run", steps)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if not path.exists():
        print(f"py-spy failed: {err.decode(errors='replace')[-500:]}")
        return None
    return str(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="profile_step", description=__doc__)
    p.add_argument("--config", default="even")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impl", action="append", help="default: hyperfsdp and fsdp2")
    p.add_argument("--out", type=Path, default=results_dir())
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--timer",
        choices=("wall", "cpu"),
        default="wall",
        help="cProfile clock: wall (default) or this thread's CPU time (robust on a busy machine)",
    )
    p.add_argument("--py-spy", action="store_true", help="also sample rank 0 with py-spy (--idle)")
    args = p.parse_args(argv)
    impls = args.impl or ["hyperfsdp", "fsdp2"]
    case = Case(args.config, args.world_size, 64 if args.config == "host-overhead" else args.layers)
    spec = case.spec()
    n_units = case.layers + 1
    args.out.mkdir(parents=True, exist_ok=True)
    template = str(args.out / "profile-{impl}-rank{rank}.prof")
    paths: dict[str, str] = {}
    spy_paths: dict[str, str] = {}
    for impl in impls:
        with RankPool(impl, args.world_size, 1, needs_process_group(impl, spec)) as pool:
            pool.wait_ready()
            pool.call("setup", spec, args.warmup)
            plain = pool.call("run", args.steps)
            prof = pool.call("profile", args.steps, template, args.timer)
            if args.py_spy:
                spy = _pyspy(pool, args.steps, args.out, impl)
                if spy:
                    spy_paths[impl] = spy
        paths[impl] = template.format(impl=impl, rank=0)
        med = sorted(max(r["wall"][i] for r in plain) for i in range(args.steps))[args.steps // 2]
        medp = sorted(max(r["wall"][i] for r in prof) for i in range(args.steps))[args.steps // 2]
        print(f"{impl}: median step {med:.3f}s unprofiled, {medp:.3f}s under cProfile (rank 0)")
    print(f"case {case.name}, {n_units} units, {args.steps} profiled steps, timer {args.timer}\n")
    print(report(paths, args.steps, args.top))
    for impl, needle in (("hyperfsdp", "hyperfsdp_core"), ("fsdp2", "torch/distributed/fsdp")):
        if impl in paths:
            print()
            print(engine_functions(paths[impl], needle, args.steps))
    for impl, path in spy_paths.items():
        print()
        print(pyspy_summary(path, impl, args.top))
    return 0
