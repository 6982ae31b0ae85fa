"""Runs the cases: fresh rank pools per implementation, a loss guard, interleaved timed rounds."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from .cases import PRESETS, Case, select_cases
from .impls import IMPLS, family, needs_process_group, parse_impl
from .launch import PoolError, RankPool

#: fp32 guard: hyperfsdp's warmup losses must match FSDP2's to this relative tolerance.
LOSS_RTOL = 1e-4
#: bf16: reported, and only a failure beyond this (a broken run, not rounding).
BF16_LOSS_RTOL = 5e-2


@attrs.define
class Options:
    preset: str = "quick"
    configs: Sequence[str] | None = None
    worlds: Sequence[int] | None = None
    layers: Sequence[int] | None = None
    impls: Sequence[str] = IMPLS
    steps: int | None = None
    rounds: int | None = None
    warmup: int | None = None
    threads: int = 1
    check: bool = True
    json_path: Path | None = None
    markdown_path: Path | None = None
    timeout: float = 900.0
    timeline: bool = False  # record a memory timeline of one step per implementation
    charts_dir: Path | None = None  # draw PNG charts there after the run


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return math.nan
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _summarize(runs: list[list[dict]], setup: list[dict], steps: int) -> dict:
    """One implementation's figures from its rounds (``runs[round][rank]``) and setup."""
    wall: list[float] = []  # per step: the slowest rank (ranks are coupled by collectives)
    cpu: list[float] = []  # per step: CPU seconds of one rank process, mean over ranks
    cpu_total: list[float] = []  # per step: summed over ranks
    fwd_bwd: list[float] = []  # per step: zero_grad + forward + backward, slowest rank
    optim: list[float] = []  # per step: optimizer.step(), slowest rank
    round_medians = []
    for per_rank in runs:
        w = [max(r["wall"][i] for r in per_rank) for i in range(len(per_rank[0]["wall"]))]
        c = [sum(r["cpu"][i] for r in per_rank) for i in range(len(per_rank[0]["cpu"]))]
        if "fwd_bwd" in per_rank[0]:
            n_steps = len(per_rank[0]["fwd_bwd"])
            fwd_bwd += [max(r["fwd_bwd"][i] for r in per_rank) for i in range(n_steps)]
            optim += [max(r["optim"][i] for r in per_rank) for i in range(n_steps)]
        wall += w
        cpu_total += c
        cpu += [x / len(per_rank) for x in c]
        round_medians.append(statistics.median(w))
    last = runs[-1]
    rank0 = [r[0] for r in runs]
    calls: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    comm_stats: dict[str, int] = {}
    for r in rank0:
        for k, v in r["calls"].items():
            calls[k] = calls.get(k, 0) + v
        for k, v in r["bytes"].items():
            nbytes[k] = nbytes.get(k, 0) + v
        for k, v in r.get("hyperfsdp_comm_stats", {}).items():
            comm_stats[k] = comm_stats.get(k, 0) + v
    n = len(wall) or 1
    out = {
        "status": "ok",
        "steps": len(wall),
        "median_s": statistics.median(wall),
        "p90_s": _quantile(wall, 0.9),
        "min_s": min(wall),
        "mean_s": statistics.fmean(wall),
        "round_medians_s": round_medians,
        "fwd_bwd_median_s": statistics.median(fwd_bwd) if fwd_bwd else None,
        "optim_median_s": statistics.median(optim) if optim else None,
        "cpu_s_per_step": statistics.median(cpu),
        "cpu_s_per_step_all_ranks": statistics.median(cpu_total),
        # minor page faults per step per rank (mean over ranks and the timed steps)
        "page_faults_per_step": (
            statistics.fmean(r["page_faults"] for per_rank in runs for r in per_rank)
            / max(1, len(runs[0][0]["wall"]))
            if "page_faults" in runs[0][0]
            else None
        ),
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_rss_bytes": [r["peak_rss"] for r in last],
        "peak_heap_bytes": [s.get("peak_heap") for s in setup],
        "heap_at_step_start_bytes": [s.get("heap_at_step_start") for s in setup],
        "peak_rss_reset": all(r["peak_reset"] for r in last),
        "rss_after_setup_bytes": [s["rss_after_setup"] for s in setup],
        "rss_at_start_bytes": [s.get("rss_at_start") for s in setup],
        "live_bytes": [s["live_bytes"] for s in setup],
        "storage_bytes": [s["storage_bytes"] for s in setup],
        "param_bytes": [s["param_bytes"] for s in setup],
        "grad_bytes": [s["grad_bytes"] for s in setup],
        "optim_bytes": [s["optim_bytes"] for s in setup],
        "padding_bytes": [s["padding_bytes"] for s in setup],
        "padded_params": [s["padded_params"] for s in setup],
        "collectives_per_step": sum(calls.values()) / n,
        "bytes_per_step": sum(nbytes.values()) / n,
        "collectives_by_op_per_step": {k: v / n for k, v in sorted(calls.items())},
        "bytes_by_op_per_step": {k: v / n for k, v in sorted(nbytes.items())},
        "comm_source": rank0[0].get("comm_source", "python_wrappers"),
        "warmup_losses": [s["warmup_losses"] for s in setup],
        "timed_losses_rank0": [x for r in rank0 for x in r["losses"]],
        "n_units": setup[0]["n_units"],
        "build_s": max(s["build_s"] for s in setup),
    }
    pool_bytes = [r.get("hyperfsdp_pool_bytes") for r in last]
    if any(b is not None for b in pool_bytes):
        out["hyperfsdp_pool_bytes"] = pool_bytes  # comm buffers kept between steps (CPU)
    if comm_stats:
        out["hyperfsdp_comm_stats_per_step"] = {k: v / n for k, v in sorted(comm_stats.items())}
        counted = comm_stats.get("all_gathers", 0) + comm_stats.get("reduce_scatters", 0)
        counted += comm_stats.get("all_reduces", 0)
        out["comm_counter_agrees"] = counted == sum(calls.values())
    return out


def _summarize_counts(per_rank: list[dict] | None) -> dict:
    """Copies and allocations of one step (``Runner.counts``), mean over ranks."""
    if not per_rank:
        return {}
    n = len(per_rank)

    def mean(key: str) -> float:
        return sum(r[key] for r in per_rank) / n

    by_op: dict[str, float] = {}
    for r in per_rank:
        for op, b in r["copy_bytes_by_op"].items():
            by_op[op] = by_op.get(op, 0) + b / n
    return {
        "copy_bytes_per_step": mean("copy_bytes"),
        "copy_calls_per_step": mean("copy_calls"),
        "copy_bytes_by_op_per_step": dict(sorted(by_op.items())),
        "allocs_per_step": mean("allocs"),
        "alloc_bytes_per_step": mean("alloc_bytes"),
        "counts_per_rank": per_rank,
    }


def reference_candidates(impl: str, config: str) -> tuple[str, ...]:
    """Which FSDP2 run an implementation is compared with, in order of preference.

    Its own family (``-foreach`` with ``fsdp2-foreach``); in the ``offload``
    configuration FSDP2 with offload (``CPUOffloadPolicy()``, refused without an
    accelerator, then ``pin_memory=False``), or FSDP2 without offload for the runs
    without it (DDP and the floor included).
    """
    base, variant = parse_impl(impl)
    if config == "offload":
        if variant == "no-offload" or base in ("ddp", "floor"):
            return ("fsdp2-no-offload",)
        return ("fsdp2", "fsdp2-unpinned")
    fam = family(impl)
    return ("fsdp2" + fam, "fsdp2") if fam else ("fsdp2",)


def reference_for(impl: str, config: str, available) -> str | None:
    """The first of :func:`reference_candidates` in ``available`` (never ``impl`` itself)."""
    for cand in reference_candidates(impl, config):
        if cand in available and cand != impl:
            return cand
    return None


def floor_for(impl: str, available) -> str | None:
    """The compute-only floor an implementation's overhead is measured against."""
    for cand in ("floor" + family(impl), "floor"):
        if cand in available:
            return cand
    return None


def guard_references(impls: Sequence[str], config: str) -> list[str]:
    """FSDP2 runs the loss guard needs that ``impls`` lacks (run untimed)."""
    extra: list[str] = []
    for impl in impls:
        if not impl.startswith("hyperfsdp"):
            continue
        cands = reference_candidates(impl, config)
        if not any(c in impls or c in extra for c in cands):
            extra.append(cands[-1])  # the one that runs anywhere
    return extra


def _loss_check(case: Case, setups: dict[str, list[dict]]) -> dict:
    """Compare hyperfsdp's warmup losses with FSDP2's (and DDP's, for information)."""
    spec = case.spec()
    rtol = BF16_LOSS_RTOL if spec.precision == "bf16" else LOSS_RTOL
    result: dict = {"rtol": rtol, "reference": "fsdp2", "compared": {}, "references": {}}
    if not any(i.startswith("hyperfsdp") for i in setups):
        result["status"] = "skipped (hyperfsdp did not run)"
        return result
    ok = True
    checked = False
    for impl in setups:
        if parse_impl(impl)[0] not in ("hyperfsdp", "ddp"):
            continue
        ref_name = reference_for(impl, case.config, setups)
        if ref_name is None:
            continue
        ref, other = setups[ref_name], setups[impl]
        worst = 0.0
        for a_rank, b_rank in zip(other, ref):
            for a, b in zip(a_rank["warmup_losses"], b_rank["warmup_losses"]):
                diff = abs(a - b) / max(1.0, abs(b)) if math.isfinite(a) else math.inf
                worst = max(worst, diff)
        result["compared"][impl] = worst
        result["references"][impl] = ref_name
        if impl.startswith("hyperfsdp"):
            checked = True
            if not worst <= rtol:
                ok = False
                result.setdefault("failed", []).append(impl)
    if not checked:
        result["status"] = "skipped (no fsdp2 reference)"
        return result
    result["status"] = "ok" if ok else "mismatch"
    return result


def run_case(case: Case, opts: Options, log: Callable[[str], None]) -> dict:
    preset = PRESETS[opts.preset]
    steps = opts.steps or preset.steps
    if case.is_host_overhead:
        steps *= 3  # tiny steps: more samples for the same time
    rounds = max(1, min(opts.rounds or preset.rounds, steps))
    warmup = opts.warmup if opts.warmup is not None else preset.warmup
    impls = list(case.impls(opts.impls))
    guard_only = guard_references(impls, case.config) if opts.check else []
    impls += guard_only  # the loss guard needs a reference; not timed
    spec = case.spec()
    result: dict = {
        "case": case.name,
        "key": case.key,
        "config": case.config,
        "world_size": case.world,
        "layers": case.layers,
        "model": spec.model.as_dict(),
        "precision": spec.precision,
        "reshard_after_forward": spec.reshard_after_forward,
        "steps_per_impl": steps,
        "rounds": rounds,
        "warmup": warmup,
        "impls": {},
        "loadavg_start": os.getloadavg(),
    }
    t0 = time.perf_counter()
    pools: dict[str, RankPool] = {}
    setups: dict[str, list[dict]] = {}
    try:
        for impl in impls:
            pools[impl] = RankPool(impl, case.world, opts.threads, needs_process_group(impl, spec))
        for impl in impls:
            try:
                pools[impl].wait_ready()
            except PoolError as exc:
                result["impls"][impl] = _error(exc)
        for impl in impls:
            if pools[impl].broken:
                continue
            try:
                setups[impl] = pools[impl].call("setup", spec, warmup, timeout=opts.timeout)
            except PoolError as exc:
                result["impls"][impl] = _error(exc)
                log(f"    {impl}: ERROR {exc}")
        if opts.timeline:
            for impl in list(setups):
                try:
                    result.setdefault("timelines", {})[impl] = pools[impl].call(
                        "timeline", timeout=opts.timeout
                    )
                except PoolError as exc:
                    result["impls"][impl] = _error(exc)
                    setups.pop(impl)
                    log(f"    {impl}: timeline ERROR {exc}")
        check = _loss_check(case, setups) if opts.check else {"status": "disabled"}
        result["loss_check"] = check
        timed = [i for i in impls if i in setups and i not in guard_only]
        for impl in check.get("failed", ()):
            worst = check["compared"][impl]
            result["impls"][impl] = {
                "status": f"FAILED loss check: max rel diff {worst:.2e} vs FSDP2 > {check['rtol']:g}",
                "warmup_losses": [s["warmup_losses"] for s in setups[impl]],
            }
            timed.remove(impl)
            log(f"    {impl}: {result['impls'][impl]['status']} (not timed)")
        runs: dict[str, list[list[dict]]] = {i: [] for i in timed}
        per_round = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
        for r, n in enumerate(per_round):
            order = timed if r % 2 == 0 else timed[::-1]  # A B C D, D C B A, ...
            for impl in order:
                if impl not in runs or pools[impl].broken:
                    continue
                try:
                    runs[impl].append(pools[impl].call("run", n, timeout=opts.timeout))
                except PoolError as exc:
                    result["impls"][impl] = _error(exc)
                    runs.pop(impl)
                    log(f"    {impl}: ERROR {exc}")
        counts: dict[str, list[dict]] = {}
        for impl in runs:  # one more step each, untimed: its copies and allocations
            if not runs[impl] or pools[impl].broken:
                continue
            try:
                counts[impl] = pools[impl].call("counts", timeout=opts.timeout)
            except PoolError as exc:
                log(f"    {impl}: counts ERROR {exc}")
        for impl, impl_runs in runs.items():
            if impl_runs:
                result["impls"][impl] = _summarize(impl_runs, setups[impl], steps)
                result["impls"][impl].update(_summarize_counts(counts.get(impl)))
    finally:
        for pool in pools.values():
            pool.close(force=bool(pool.broken))
    _add_ratios(result)
    result["loadavg_end"] = os.getloadavg()
    result["elapsed_s"] = time.perf_counter() - t0
    return result


def _error(exc: PoolError) -> dict:
    text = str(exc)
    if "Refused: " in text:  # the implementation declines this configuration (impls.Refused)
        return {"status": "refused: " + text.split("Refused: ", 1)[1], "details": exc.details}
    return {"status": f"error: {text}", "details": exc.details}


def _add_ratios(result: dict) -> None:
    impls = result["impls"]
    ok = {k: v for k, v in impls.items() if v.get("status") == "ok"}
    units = result["layers"] + 1  # one unit per block plus the root (floor: same modules)
    host = result["config"] == "host-overhead"
    for name, r in ok.items():
        ref_name = reference_for(name, result["config"], ok)
        floor_name = floor_for(name, ok)
        ref = ok.get(ref_name) if ref_name is not None else None
        floor = ok.get(floor_name) if floor_name is not None else None
        if name.startswith("fsdp2") and ref is None:
            ref, ref_name = r, name  # FSDP2 itself (or a variant without its own reference)
        if ref is not None:
            r["reference"] = ref_name
            r["ratio_vs_fsdp2"] = r["median_s"] / ref["median_s"]
            r["cpu_ratio_vs_fsdp2"] = r["cpu_s_per_step"] / ref["cpu_s_per_step"]
            r["round_ratios_vs_fsdp2"] = [
                a / b for a, b in zip(r["round_medians_s"], ref["round_medians_s"])
            ]
        if floor is not None:
            r["floor"] = floor_name
            r["ratio_vs_floor"] = r["median_s"] / floor["median_s"]
        if not host:
            continue
        r["s_per_unit_step"] = r["median_s"] / units
        if floor is None:
            continue
        r["overhead_s_per_unit_step"] = (r["median_s"] - floor["median_s"]) / units
        if r.get("fwd_bwd_median_s") is not None and floor.get("fwd_bwd_median_s") is not None:
            r["engine_overhead_s_per_unit_step"] = (
                r["fwd_bwd_median_s"] - floor["fwd_bwd_median_s"]
            ) / units
            r["optim_overhead_s_per_unit_step"] = (
                r["optim_median_s"] - floor["optim_median_s"]
            ) / units
    if host:  # overhead ratios against the reference's overhead
        for r in ok.values():
            ref = ok.get(r.get("reference", ""))
            if ref is None:
                continue
            for key in (
                "overhead_s_per_unit_step",
                "engine_overhead_s_per_unit_step",
                "optim_overhead_s_per_unit_step",
            ):
                if r.get(key) is not None and ref.get(key):
                    r[key.replace("_s_per_unit_step", "_ratio_vs_fsdp2")] = r[key] / ref[key]


# -- the whole run -----------------------------------------------------------------------------------


def machine_info() -> dict:
    import torch

    info: dict = {
        "nproc": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "loadavg": os.getloadavg(),
    }
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(
            (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in out.splitlines())
        )
        info["cpu_model"] = fields.get("Model name")
        info["lscpu"] = {k: fields.get(k) for k in ("CPU(s)", "Thread(s) per core", "L3 cache")}
    except (OSError, subprocess.SubprocessError):
        pass
    repo = Path(__file__).resolve().parent.parent.parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        info["git"] = sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    info["engine_digest"] = _engine_digest()
    return info


def _engine_digest() -> str | None:
    """A short hash of hyperfsdp_core's sources (the tree may be dirty while benchmarking)."""
    import hashlib

    try:
        import hyperfsdp_core
    except ImportError:
        return None
    root = Path(hyperfsdp_core.__file__).resolve().parent
    h = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:10]


def run(opts: Options, argv: Sequence[str] | None = None) -> dict:
    from . import report

    preset = PRESETS[opts.preset]
    cases = select_cases(preset, opts.configs, opts.worlds, opts.layers)
    log = _logger()
    results = {
        "command": " ".join(argv) if argv is not None else " ".join(sys.argv),
        "preset": opts.preset,
        "options": {
            "steps": opts.steps or preset.steps,
            "rounds": opts.rounds or preset.rounds,
            "warmup": opts.warmup if opts.warmup is not None else preset.warmup,
            "threads_per_rank": opts.threads,
            "impls": list(opts.impls),
            "loss_check": opts.check,
        },
        "machine": machine_info(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cases": [],
    }
    log(
        f"hyperfsdp bench ({opts.preset}): {len(cases)} case(s), impls {', '.join(opts.impls)}, "
        f"torch {results['machine']['torch']}, {results['machine']['nproc']} CPUs"
    )
    t0 = time.perf_counter()
    for i, case in enumerate(cases, 1):
        log(f"[{i}/{len(cases)}] {case.name} ...")
        res = run_case(case, opts, log)
        results["cases"].append(res)
        log("    " + report.case_line(res) + f"  ({res['elapsed_s']:.0f}s)")
        if opts.json_path is not None:  # keep partial results if interrupted
            _write_json(opts.json_path, results)
    results["elapsed_s"] = time.perf_counter() - t0
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    print()
    print(report.render(results))
    if opts.json_path is not None:
        _write_json(opts.json_path, results)
        print(f"\nresults: {opts.json_path}")
    _write_extras(results, opts)
    return results


def merge_results(loaded: Sequence[dict]) -> dict:
    """Several results files as one (a case in a later file replaces the same case)."""
    if not loaded:
        raise ValueError("no results to merge")
    merged = dict(loaded[-1])
    cases: dict[str, dict] = {}
    for results in loaded:
        for case in results.get("cases", []):
            cases.pop(case["key"], None)
            cases[case["key"]] = case
    merged["cases"] = list(cases.values())
    if len(loaded) > 1:
        merged["merged_from"] = [r.get("command") for r in loaded]
    return merged


def replot(paths: Sequence[Path], opts: Options) -> int:
    """``--replot``: the tables and charts of earlier results, without running anything."""
    from . import report

    results = merge_results([json.loads(Path(p).read_text()) for p in paths])
    print(report.render(results))
    _write_extras(results, opts)
    return 0


def _write_extras(results: dict, opts: Options) -> None:
    """The Markdown tables and the charts that ``opts`` asks for."""
    from . import report

    if opts.markdown_path is not None:
        opts.markdown_path.parent.mkdir(parents=True, exist_ok=True)
        opts.markdown_path.write_text(report.render(results, markdown=True) + "\n")
        print(f"markdown: {opts.markdown_path}")
    if opts.charts_dir is not None:
        _draw(results, opts.charts_dir)


def _draw(results: dict, directory: Path) -> None:
    from . import charts

    for path in charts.draw_all(results, directory):
        print(f"chart: {path}")


def _write_json(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)


def _logger() -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    return log
