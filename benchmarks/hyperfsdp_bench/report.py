"""Tables for the terminal and for docs/performance.md (ratios vs FSDP2 first)."""

from __future__ import annotations

import math
from collections.abc import Sequence

MiB = 1024 * 1024


def peak_over_ranks(r: dict, key: str) -> int | None:
    """The largest per-rank figure of one implementation's ``r[key]`` (peak RSS or heap
    bytes; zeros, where a rank could not measure, are left out), or None."""
    return max((x for x in r.get(key, []) if x), default=None)


def rss_growth(r: dict) -> int | None:
    """The largest per-rank growth of resident memory: a rank's peak RSS in the timed steps
    minus its RSS when it started (interpreter, torch and the process group, before the
    model is built: the same for every implementation), or None where not measured."""
    pairs = zip(r.get("peak_rss_bytes", []), r.get("rss_at_start_bytes", []))
    return max((peak - start for peak, start in pairs if peak and start), default=None)


def _f(x, fmt: str = ".3f", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, fmt)


def _ratio(x) -> str:
    return _f(x, ".2f") + "x" if x is not None else "-"


def _range(xs: Sequence[float] | None) -> str:
    if not xs:
        return "-"
    return f"{min(xs):.2f}-{max(xs):.2f}"


def _table(headers: list[str], rows: list[list[str]], markdown: bool, right: set[int]) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |"]
        lines.append(
            "|" + "|".join("---:" if i in right else "---" for i in range(len(headers))) + "|"
        )
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def fmt(r: list[str]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ]
        return "  ".join(cells).rstrip()

    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def case_line(res: dict) -> str:
    """One progress line per case."""
    parts = []
    for impl, r in res["impls"].items():
        if r.get("status") != "ok":
            parts.append(f"{impl} {r.get('status', '?')[:60]}")
        else:
            extra = (
                f" ({r['ratio_vs_fsdp2']:.2f}x fsdp2)"
                if impl == "hyperfsdp" and "ratio_vs_fsdp2" in r
                else ""
            )
            parts.append(f"{impl} {r['median_s']:.3f}s{extra}")
    return "; ".join(parts)


#: opt-in hyperfsdp variants that get a column of their own in the summary
SUMMARY_VARIANTS = ("hyperfsdp-tuned", "hyperfsdp-native", "hyperfsdp-core", "hyperfsdp-foreach")


def summary_table(results: dict, markdown: bool = False) -> str:
    variants = [v for v in SUMMARY_VARIANTS if any(v in res["impls"] for res in results["cases"])]
    headers = [
        "case",
        "hyperfsdp/FSDP2 time",
        "per-round range",
        "CPU/FSDP2",
        "hyperfsdp/floor",
        "FSDP2/floor",
        "DDP/FSDP2",
        *(v.removeprefix("hyperfsdp-") + "/FSDP2" for v in variants),
        "loss check",
    ]
    rows = []
    for res in results["cases"]:
        if res["config"] == "host-overhead":
            continue
        imp = res["impls"]
        h, d = imp.get("hyperfsdp", {}), imp.get("ddp", {})
        ref_name = h.get("reference", "fsdp2")
        f = imp.get(ref_name, {})
        check = res.get("loss_check", {})
        cstatus = check.get("status", "-")
        if "hyperfsdp" in check.get("compared", {}):
            worst = check["compared"]["hyperfsdp"]
            cstatus += " (exact)" if worst == 0 else f" (rel {worst:.0e})"
        tcol = [_ratio(imp.get(v, {}).get("ratio_vs_fsdp2")) for v in variants]
        name = res["case"] + (f" (vs {ref_name})" if ref_name != "fsdp2" else "")
        if h.get("status", "ok") != "ok":
            hcol = "FAILED loss check" if "loss check" in h["status"] else "error (see notes)"
            rows.append(
                [
                    name,
                    hcol,
                    "-",
                    "-",
                    "-",
                    _ratio(f.get("ratio_vs_floor")),
                    _ratio(d.get("ratio_vs_fsdp2")),
                    *tcol,
                    cstatus,
                ]
            )
            continue
        rows.append(
            [
                name,
                _ratio(h.get("ratio_vs_fsdp2")),
                _range(h.get("round_ratios_vs_fsdp2")),
                _ratio(h.get("cpu_ratio_vs_fsdp2")),
                _ratio(h.get("ratio_vs_floor")),
                _ratio(f.get("ratio_vs_floor")),
                _ratio(d.get("ratio_vs_fsdp2")),
                *tcol,
                cstatus,
            ]
        )
    return _table(headers, rows, markdown, right=set(range(1, len(headers) - 1)))


def _note(notes: list[str], res: dict, impl: str, r: dict) -> str:
    """Errors go under the tables as numbered notes; the cell says which."""
    status = (r.get("status") or "?").strip().splitlines()[0]
    notes.append(f"[{len(notes) + 1}] {res['case']} {impl}: {status[:300]}")
    kind = (
        "FAILED"
        if "loss check" in status
        else "refused"
        if status.startswith("refused")
        else "error"
    )
    return f"{kind} [{len(notes)}]"


def detail_table(results: dict, markdown: bool = False, notes: list[str] | None = None) -> str:
    headers = [
        "case",
        "impl",
        "median s",
        "p90 s",
        "xFSDP2",
        "xfloor",
        "fwd+bwd s",
        "optim s",
        "CPU s/step",
        "CPU xFSDP2",
        "faults/step",
        "peak RSS MiB",
        "peak heap MiB",
        "live MiB",
        "pad KiB",
        "coll/step",
        "MiB moved/step",
    ]
    notes = [] if notes is None else notes
    rows = []
    for res in results["cases"]:
        if res["config"] == "host-overhead":
            continue
        for impl, r in res["impls"].items():
            if r.get("status") != "ok":
                rows.append([res["case"], impl, _note(notes, res, impl, r)] + [""] * 14)
                continue
            peak = peak_over_ranks(r, "peak_rss_bytes")
            heap = peak_over_ranks(r, "peak_heap_bytes")
            rows.append(
                [
                    res["case"],
                    impl,
                    _f(r["median_s"]),
                    _f(r["p90_s"]),
                    _ratio(r.get("ratio_vs_fsdp2")),
                    _ratio(r.get("ratio_vs_floor")),
                    _f(r.get("fwd_bwd_median_s")),
                    _f(r.get("optim_median_s")),
                    _f(r["cpu_s_per_step"]),
                    _ratio(r.get("cpu_ratio_vs_fsdp2")),
                    _f(r.get("page_faults_per_step"), ".0f"),
                    _f(peak / MiB if peak else None, ".0f"),
                    _f(heap / MiB if heap else None, ".0f"),
                    _f(max(r["live_bytes"]) / MiB, ".1f"),
                    _f(max(r["padding_bytes"]) / 1024, ".1f"),
                    _f(r["collectives_per_step"], ".0f"),
                    _f(r["bytes_per_step"] / MiB, ".1f"),
                ]
            )
    return _table(headers, rows, markdown, right=set(range(2, 17)))


def host_overhead_table(
    results: dict, markdown: bool = False, notes: list[str] | None = None
) -> str:
    """Per unit and step: the whole overhead over the floor, then its engine part (forward +
    backward minus the floor's) and its optimizer part (step minus the floor's)."""
    headers = [
        "case",
        "impl",
        "units",
        "median ms/step",
        "fwd+bwd ms",
        "optim ms",
        "overhead ms/unit",
        "xFSDP2",
        "engine ms/unit",
        "xFSDP2",
        "optimizer ms/unit",
        "xFSDP2",
        "CPU ms/step",
    ]
    notes = [] if notes is None else notes
    rows = []

    def ms(r: dict, key: str, fmt: str = ".3f") -> str:
        x = r.get(key)
        return _f(x * 1e3 if x is not None else None, fmt)

    for res in results["cases"]:
        if res["config"] != "host-overhead":
            continue
        for impl, r in res["impls"].items():
            if r.get("status") != "ok":
                rows.append([res["case"], impl, "", _note(notes, res, impl, r)] + [""] * 9)
                continue
            rows.append(
                [
                    res["case"],
                    impl,
                    str(res["layers"] + 1),
                    ms(r, "median_s", ".1f"),
                    ms(r, "fwd_bwd_median_s", ".1f"),
                    ms(r, "optim_median_s", ".1f"),
                    ms(r, "overhead_s_per_unit_step"),
                    _ratio(r.get("overhead_ratio_vs_fsdp2")),
                    ms(r, "engine_overhead_s_per_unit_step"),
                    _ratio(r.get("engine_overhead_ratio_vs_fsdp2")),
                    ms(r, "optim_overhead_s_per_unit_step"),
                    _ratio(r.get("optim_overhead_ratio_vs_fsdp2")),
                    ms(r, "cpu_s_per_step", ".1f"),
                ]
            )
    return _table(headers, rows, markdown, right=set(range(2, 13)))


def offload_table(results: dict, markdown: bool = False) -> str:
    """Offload cases: every run against hyperfsdp without offload, DDP and the floor."""
    headers = [
        "case",
        "impl",
        "median s",
        "x hyperfsdp no offload",
        "xDDP",
        "xfloor",
        "CPU s/step",
        "peak RSS MiB",
        "peak heap MiB",
        "status",
    ]
    rows = []
    for res in results["cases"]:
        if res["config"] != "offload":
            continue
        imp = res["impls"]
        ok = {k: v for k, v in imp.items() if v.get("status") == "ok"}
        base, ddp, floor = ok.get("hyperfsdp-no-offload"), ok.get("ddp"), ok.get("floor")
        for impl, r in imp.items():
            if r.get("status") != "ok":
                status = (r.get("status") or "?").strip().splitlines()[0]
                rows.append([res["case"], impl] + ["-"] * 7 + [status[:90]])
                continue
            peak = peak_over_ranks(r, "peak_rss_bytes")
            heap = peak_over_ranks(r, "peak_heap_bytes")

            def rel(other: dict | None, r: dict = r) -> str:
                return _ratio(r["median_s"] / other["median_s"]) if other else "-"

            rows.append(
                [
                    res["case"],
                    impl,
                    _f(r["median_s"]),
                    rel(base),
                    rel(ddp),
                    rel(floor),
                    _f(r["cpu_s_per_step"]),
                    _f(peak / MiB if peak else None, ".0f"),
                    _f(heap / MiB if heap else None, ".0f"),
                    "ok",
                ]
            )
    return _table(headers, rows, markdown, right=set(range(2, 9)))


def _short_op(name: str) -> str:
    return name.replace("aten::", "").replace("fsdp::", "fsdp.")


def copies_table(results: dict, markdown: bool = False) -> str:
    """Per implementation: step time, peak memory, and the copies and allocations of one
    untimed step (mean over ranks), with ratios to the reference FSDP2 run."""
    headers = [
        "case",
        "impl",
        "time xFSDP2",
        "peak RSS MiB",
        "RSS xFSDP2",
        "RSS growth MiB",
        "growth xFSDP2",
        "peak heap xFSDP2",
        "MiB copied/step",
        "copies xFSDP2",
        "allocs/step",
        "allocs xFSDP2",
        "MiB allocated/step",
        "copied by op (MiB)",
    ]
    rows = []
    for res in results["cases"]:
        if res["config"] == "host-overhead":
            continue
        ok = {k: v for k, v in res["impls"].items() if v.get("status") == "ok"}
        for impl, r in ok.items():
            if r.get("copy_bytes_per_step") is None:
                continue
            ref = ok.get(r.get("reference", ""))

            def rel(key: str, r: dict = r, ref: dict | None = ref) -> str:
                if ref is None or not ref.get(key):
                    return "-"
                return _ratio(r[key] / ref[key])

            def peak_rel(key: str, r: dict = r, ref: dict | None = ref) -> str:
                a, b = peak_over_ranks(r, key), peak_over_ranks(ref or {}, key)
                return _ratio(a / b) if a and b else "-"

            peak = peak_over_ranks(r, "peak_rss_bytes")
            growth, ref_growth = rss_growth(r), rss_growth(ref or {})
            ops = sorted(r["copy_bytes_by_op_per_step"].items(), key=lambda kv: -kv[1])
            by_op = ", ".join(f"{_short_op(k)} {v / MiB:.1f}" for k, v in ops[:4] if v >= MiB / 10)
            rows.append(
                [
                    res["case"],
                    impl,
                    _ratio(r.get("ratio_vs_fsdp2")),
                    _f(peak / MiB if peak else None, ".0f"),
                    peak_rel("peak_rss_bytes"),
                    _f(growth / MiB if growth else None, ".0f"),
                    _ratio(growth / ref_growth) if growth and ref_growth else "-",
                    peak_rel("peak_heap_bytes"),
                    _f(r["copy_bytes_per_step"] / MiB, ".1f"),
                    rel("copy_bytes_per_step"),
                    _f(r["allocs_per_step"], ".0f"),
                    rel("allocs_per_step"),
                    _f(r["alloc_bytes_per_step"] / MiB, ".0f"),
                    by_op or "-",
                ]
            )
    return _table(headers, rows, markdown, right=set(range(2, 13)))


def timeline_table(results: dict, markdown: bool = False) -> str:
    """Cases run with ``--timeline``: where one step's heap in use peaks (rank 0)."""
    from .timeline import summarize

    headers = [
        "case",
        "impl",
        "step start MiB",
        "peak MiB",
        "peak in",
        "fwd peak",
        "bwd peak",
        "optim peak",
        "end MiB",
    ]
    rows = []
    for res in results["cases"]:
        for impl, per_rank in (res.get("timelines") or {}).items():
            info = summarize(per_rank[0])
            if not info:
                continue
            sec = info["section_peaks"]

            def mib(x) -> str:
                return _f(x / MiB if x is not None else None, ".0f")

            rows.append(
                [
                    res["case"],
                    impl,
                    mib(info["start_bytes"]),
                    mib(info["peak_bytes"]),
                    f"{info['peak_phase']} ({info['peak_section']})",
                    mib(sec.get("forward")),
                    mib(sec.get("backward")),
                    mib(sec.get("optimizer")),
                    mib(info["end_bytes"]),
                ]
            )
    return _table(headers, rows, markdown, right={2, 3, 5, 6, 7, 8})


def render(results: dict, markdown: bool = False) -> str:
    m = results.get("machine", {})
    title = (lambda s: f"### {s}\n") if markdown else (lambda s: f"== {s} ==")
    notes: list[str] = []
    parts = [
        title("hyperfsdp vs FSDP2 (median step time ratio; <1 is faster)"),
        summary_table(results, markdown),
        "",
        title("per implementation"),
        detail_table(results, markdown, notes),
    ]
    host = host_overhead_table(results, markdown, notes)
    if host.count("\n") > 1:
        parts += [
            "",
            title(
                "host overhead per unit (tiny blocks): step minus the floor's, and its "
                "engine (fwd+bwd) and optimizer parts"
            ),
            host,
        ]
    copies = copies_table(results, markdown)
    if copies.count("\n") > 1:
        parts += [
            "",
            title(
                "memory, copies and allocations per step (one untimed step, mean over ranks; "
                "copies: bytes written by copy ops, allocations: torch's CPU allocator)"
            ),
            copies,
        ]
    offload = offload_table(results, markdown)
    if offload.count("\n") > 1:
        parts += ["", title("offload (CPUOffloadPolicy)"), offload]
    timeline = timeline_table(results, markdown)
    if timeline.count("\n") > 1:
        parts += ["", title("memory timeline of one step (heap in use, rank 0)"), timeline]
    if notes:
        parts += ["", "notes (tracebacks in the JSON):"]
        parts += [("- " if markdown else "  ") + n for n in notes]
    opts = results["options"]
    parts += [
        "",
        f"machine: {m.get('cpu_model')}, {m.get('nproc')} CPUs, torch {m.get('torch')}, "
        f"python {m.get('python')}, git {m.get('git')} (engine digest {m.get('engine_digest')}); "
        f"preset {results.get('preset')}, {opts['steps']} timed steps/impl in {opts['rounds']} "
        f"interleaved rounds, {opts['threads_per_rank']} thread(s)/rank",
    ]
    return "\n".join(parts)
