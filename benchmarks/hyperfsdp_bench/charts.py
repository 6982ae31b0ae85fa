"""PNG charts from benchmark results (matplotlib: the ``charts`` extra, ``pip install -e 'benchmarks[charts]'``).

- ``timeline-<case>.png``: heap in use over one step (rank 0), one panel per
  implementation, with each block's forward and backward start, the optimizer step and
  the collectives marked (cases run with ``--timeline``);
- ``scaling-layers.png`` / ``scaling-world.png``: median step time, peak RSS and peak heap
  in use of every implementation against the depth (``even``, world 2) and against the
  world size (``even``, 8 layers): the cases of the ``--scaling`` preset that ran.

The data assembly (``scaling_data``, ``timeline_series``) is plain Python and unit-tested;
only the ``draw_*`` functions import matplotlib.
"""

from __future__ import annotations

from pathlib import Path

from .report import peak_over_ranks

MiB = 1024 * 1024
#: drawing order and colours (others follow in the order they ran)
IMPL_ORDER = ("hyperfsdp", "fsdp2", "ddp", "floor")
COLORS = {
    "hyperfsdp": "tab:blue",
    "fsdp2": "tab:red",
    "ddp": "tab:green",
    "floor": "tab:gray",
    "hyperfsdp-core": "tab:cyan",
    "hyperfsdp-native": "tab:olive",
}
#: the scaling sweep's axes: (config, fixed world, depths) and (config, fixed depth, worlds)
LAYERS_AXIS = ("even", 2, (4, 8, 16, 32))
WORLD_AXIS = ("even", 8, (1, 2, 4))


def _ordered(names) -> list[str]:
    names = list(names)
    return [n for n in IMPL_ORDER if n in names] + [n for n in names if n not in IMPL_ORDER]


def _point(res: dict | None, impl: str) -> tuple[float | None, float | None, float | None]:
    """(median step s, peak RSS MiB, peak heap MiB) of one implementation in one case."""
    if res is None:
        return None, None, None
    r = res["impls"].get(impl)
    if r is None or r.get("status") != "ok":
        return None, None, None
    rss, heap = peak_over_ranks(r, "peak_rss_bytes"), peak_over_ranks(r, "peak_heap_bytes")
    return r["median_s"], rss / MiB if rss else None, heap / MiB if heap else None


def scaling_data(results: dict) -> dict:
    """Step time and memory against depth and world size, from the ``even`` cases that ran.

    Returns ``{"layers": axis, "world": axis}``; an axis is ``{"x": [...], "fixed": ...,
    "impls": {impl: {"time": [...], "rss": [...], "heap": [...]}}}`` with ``None`` where a
    point did not run (or failed); an axis with fewer than two points that ran is left out.
    """
    by_key = {(c["config"], c["world_size"], c["layers"]): c for c in results.get("cases", [])}
    out: dict = {}
    for axis, (config, fixed, xs) in (("layers", LAYERS_AXIS), ("world", WORLD_AXIS)):
        cases = [
            by_key.get((config, fixed, x) if axis == "layers" else (config, x, fixed)) for x in xs
        ]
        present = [(x, c) for x, c in zip(xs, cases) if c is not None]
        if len(present) < 2:
            continue
        impls = _ordered({i for _, c in present for i in c["impls"]})
        series = {}
        for impl in impls:
            points = [_point(c, impl) for _, c in present]
            if all(p[0] is None for p in points):
                continue
            series[impl] = {
                "time": [p[0] for p in points],
                "rss": [p[1] for p in points],
                "heap": [p[2] for p in points],
            }
        out[axis] = {
            "x": [x for x, _ in present],
            "fixed": fixed,
            "config": config,
            "impls": series,
        }
    return out


def timeline_series(per_rank: list[dict], rank: int = 0) -> dict:
    """One rank's timeline as plottable series: milliseconds, MiB, and markers by kind."""
    tl = per_rank[rank]
    t = [s[0] * 1e3 for s in tl["samples"]]
    mib = [s[1] / MiB for s in tl["samples"]]
    rss = [s[2] / MiB if len(s) > 2 and s[2] is not None else None for s in tl["samples"]]
    marks: dict[str, list[tuple[float, str]]] = {}
    for mt, kind, label in tl["markers"]:
        if kind == "coll":  # by the torch.distributed function called
            name = label.split()[0]
            kind = (
                "gather"
                if "all_gather" in name
                else "reduce"
                if "reduce_scatter" in name
                else "all_reduce"
                if "all_reduce" in name
                else "coll"
            )
        elif kind == "phase" and label == "optimizer":
            kind = "optimizer"
        marks.setdefault(kind, []).append((mt * 1e3, label))
    return {"t_ms": t, "mib": mib, "rss_mib": rss, "marks": marks}


# -- drawing --------------------------------------------------------------------------------


def _plt():
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "hyperfsdp bench --charts needs matplotlib (a benchmark-only extra): "
            "pip install -e 'benchmarks[charts]'  (or: make charts)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline_impls(case: dict) -> list[str]:
    """Whose timelines a case's chart shows: hyperfsdp and the FSDP2 run it is compared with
    (``fsdp2``; in the offload case the FSDP2 offload that ran), else every one recorded."""
    timelines = case.get("timelines") or {}
    ref = case.get("impls", {}).get("hyperfsdp", {}).get("reference", "fsdp2")
    names = [i for i in ("hyperfsdp", ref) if i in timelines]
    return names if len(names) == 2 else _ordered(timelines)


def draw_timeline(case: dict, path: Path) -> Path:
    """One panel per implementation: heap in use over one step, markers, the peak."""
    from .timeline import summarize

    plt = _plt()
    timelines = case["timelines"]
    names = timeline_impls(case)
    fig, axes = plt.subplots(
        len(names), 1, figsize=(11, 3.2 * len(names)), squeeze=False, sharex=True
    )
    ymax = (
        max(
            max(max(s[1], (s[2] if len(s) > 2 else None) or 0) for s in timelines[n][0]["samples"])
            for n in names
        )
        / MiB
        * 1.08
    )
    style = {
        "fwd": ("tab:blue", "-", "block forward start"),
        "bwd": ("tab:orange", "-", "block backward start"),
        "optimizer": ("tab:green", "-", "optimizer.step()"),
    }
    for ax, name in zip(axes[:, 0], names):
        series = timeline_series(timelines[name])
        info = summarize(timelines[name][0])
        color = COLORS.get(name, "black")
        ax.plot(series["t_ms"], series["mib"], color=color, lw=1.2, label="heap in use")
        rss = [(t, r) for t, r in zip(series["t_ms"], series["rss_mib"]) if r is not None]
        if rss:
            ax.plot(*zip(*rss), color=color, lw=0.8, ls="--", alpha=0.7, label="resident (RSS)")
        for kind, (color, ls, label) in style.items():
            for i, (mt, _) in enumerate(series["marks"].get(kind, [])):
                ax.axvline(
                    mt, color=color, ls=ls, lw=0.6, alpha=0.6, label=label if i == 0 else None
                )
        for kind, color, label in (
            ("gather", "tab:purple", "all-gather issued"),
            ("reduce", "tab:brown", "reduce-scatter issued"),
            ("all_reduce", "tab:olive", "all-reduce issued"),
        ):
            xs = [mt for mt, _ in series["marks"].get(kind, [])]
            if xs:
                ax.plot(xs, [ymax * 0.02] * len(xs), "|", color=color, ms=8, label=label)
        if info:
            ax.plot([info["peak_t"] * 1e3], [info["peak_bytes"] / MiB], "v", color="black")
            ax.annotate(
                f"peak {info['peak_bytes'] / MiB:.0f} MiB ({info['peak_phase']})",
                (info["peak_t"] * 1e3, info["peak_bytes"] / MiB),
                textcoords="offset points",
                xytext=(6, 4),
                fontsize=8,
            )
        ax.set_ylim(0, ymax)
        ax.set_ylabel("MiB")
        ax.set_title(f"{case['case']}: {name} (rank 0)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, loc="lower right", ncol=3)
    axes[-1, 0].set_xlabel("ms since the step started (zero_grad)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_scaling(data: dict, directory: Path) -> list[Path]:
    """``scaling-layers.png`` and ``scaling-world.png`` from :func:`scaling_data`."""
    plt = _plt()
    paths = []
    for axis, axis_data in data.items():
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        xs = axis_data["x"]
        for name, series in axis_data["impls"].items():
            for ax, key in zip(axes, ("time", "rss", "heap")):
                pts = [(x, y) for x, y in zip(xs, series[key]) if y is not None]
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        "o-",
                        color=COLORS.get(name),
                        label=name,
                    )
        xlabel = (
            f"layers ({axis_data['config']}, world {axis_data['fixed']})"
            if axis == "layers"
            else f"world size ({axis_data['config']}, {axis_data['fixed']} layers)"
        )
        for ax, ylabel in zip(
            axes, ("median step time, s", "peak RSS per rank, MiB", "peak heap in use, MiB")
        ):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_xticks(xs)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.tight_layout()
        path = directory / f"scaling-{axis}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def draw_all(results: dict, directory: Path) -> list[Path]:
    """Every chart the results support; returns the files written."""
    directory = Path(directory)
    paths = []
    for case in results.get("cases", []):
        if case.get("timelines"):
            paths.append(draw_timeline(case, directory / f"timeline-{case['key']}.png"))
    data = scaling_data(results)
    if data:
        paths += draw_scaling(data, directory)
    return paths
