"""``hyperfsdp bench``: hyperfsdp vs torch FSDP2 vs DDP vs a compute-only floor, side by side.

The suite itself lives in the checkout's ``benchmarks/`` folder (next to this
package), not in the installed distribution; this module only parses the
command line, finds that folder and runs it. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _checkout_benchmarks() -> Path:
    import hyperfsdp_core

    return Path(hyperfsdp_core.__file__).resolve().parent.parent / "benchmarks"


def available() -> bool:
    """Whether the suite is here: a source checkout (``pip install -e .``), not a wheel."""
    return (_checkout_benchmarks() / "hyperfsdp_bench" / "__init__.py").is_file()


def _names():
    """The suite's configuration and implementation names (``hyperfsdp_bench.names``)."""
    path = benchmarks_dir()
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))  # spawned rank processes inherit sys.path
    from hyperfsdp_bench import names

    return names


def benchmarks_dir() -> Path:
    """The checkout's ``benchmarks/`` folder (a clear error when this is not a checkout)."""
    path = _checkout_benchmarks()
    if not available():
        raise SystemExit(
            f"hyperfsdp bench: the benchmark suite is not at {path}. It ships with the source "
            "checkout, not the wheel: clone the repository and install it editable "
            "(pip install -e .), then run `hyperfsdp bench` (or `make bench`) there."
        )
    return path


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = _names()
    preset = p.add_mutually_exclusive_group()
    preset.add_argument(
        "--quick",
        dest="preset",
        action="store_const",
        const="quick",
        help="the default: main cases, few steps (~15 minutes on 2 cores)",
    )
    preset.add_argument(
        "--full",
        dest="preset",
        action="store_const",
        const="full",
        help="every config x world size {2,4} x layers {4,8,16}, more steps",
    )
    preset.add_argument(
        "--scaling",
        dest="preset",
        action="store_const",
        const="scaling",
        help="the scaling sweep: even at world 2 x layers {4,8,16,32} and 8 layers x world "
        "{1,2,4} (about 10 minutes on 2 cores; with --charts, the scaling charts)",
    )
    p.set_defaults(preset="quick")
    p.add_argument(
        "--config",
        action="append",
        choices=(*names.MODEL_CONFIGS, names.HOST_OVERHEAD),
        help="run only these configurations (repeatable); combinations the preset lacks are built",
    )
    p.add_argument(
        "--world-size", action="append", type=_positive, help="only these world sizes (repeatable)"
    )
    p.add_argument(
        "--layers", action="append", type=_positive, help="only these depths (repeatable)"
    )
    p.add_argument(
        "--impl",
        action="append",
        choices=names.IMPLS + names.VARIANTS,
        help="only these implementations (repeatable; default: the four main ones; "
        "hyperfsdp-tuned adds hyperfsdp with its CPU communication knobs on; hyperfsdp-native "
        "with gloo's own all-gather and reduce-scatter; hyperfsdp-gloo without the "
        "shared-memory collectives (gloo point-to-point); <impl>-foreach that implementation "
        "with torch.optim.AdamW(foreach=True))",
    )
    p.add_argument(
        "--steps",
        type=_positive,
        help="timed steps per implementation (quick 12, full 30, scaling 18)",
    )
    p.add_argument(
        "--rounds", type=_positive, help="interleaved rounds (quick 3, full 5, scaling 3)"
    )
    p.add_argument("--warmup", type=int, help="untimed steps before timing (default 3)")
    p.add_argument(
        "--threads", type=_positive, default=1, help="torch threads per rank (default 1)"
    )
    p.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the loss guard (hyperfsdp vs FSDP2 warmup losses must agree)",
    )
    p.add_argument(
        "--json",
        dest="json_path",
        type=Path,
        metavar="PATH",
        help="where to write the results (default benchmarks/results/latest.json)",
    )
    p.add_argument(
        "--markdown", type=Path, metavar="PATH", help="also write the tables as Markdown"
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also record a memory timeline of one step per implementation (heap in use "
        "over time, each block's forward and backward start, the optimizer step)",
    )
    p.add_argument(
        "--charts",
        type=Path,
        metavar="DIR",
        help="draw PNG charts into DIR (needs matplotlib: pip install -e '.[bench]'): the "
        "memory timelines of cases run with --timeline, and step time / peak memory against "
        "layers and world size from the cases of the scaling sweep that ran",
    )
    p.add_argument(
        "--replot",
        action="append",
        type=Path,
        metavar="JSON",
        help="run nothing: draw --charts (and print the tables) from earlier results "
        "(repeatable; later files win for the same case)",
    )
    p.add_argument("--list", action="store_true", help="list the cases that would run, and exit")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="benchmark hyperfsdp against torch FSDP2, DDP and a compute-only floor",
        description=(
            "Train a Llama-like model with each implementation in fresh CPU rank processes "
            "(gloo), interleaved, and report step time, CPU time, memory and communication. "
            "Results go to the terminal and to a JSON file."
        ),
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    path = benchmarks_dir()
    names = _names()  # puts the suite on sys.path
    from hyperfsdp_bench.cases import PRESETS, select_cases
    from hyperfsdp_bench.suite import Options
    from hyperfsdp_bench.suite import run as run_suite

    opts = Options(
        preset=args.preset,
        configs=args.config,
        worlds=args.world_size,
        layers=args.layers,
        impls=tuple(args.impl) if args.impl else names.IMPLS,
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        threads=args.threads,
        check=args.check,
        json_path=args.json_path or path / "results" / "latest.json",
        markdown_path=args.markdown,
        timeline=args.timeline,
        charts_dir=args.charts,
    )
    if args.replot:
        from hyperfsdp_bench.suite import replot

        return replot(args.replot, opts)
    if args.list:
        for case in select_cases(PRESETS[opts.preset], opts.configs, opts.worlds, opts.layers):
            print(f"{case.name:24s} impls: {', '.join(case.impls(opts.impls))}")
        return 0
    run_suite(opts, argv if argv is not None else ["hyperfsdp", *sys.argv[1:]])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hyperfsdp_core.bench`` (the same as ``hyperfsdp bench``)."""
    parser = argparse.ArgumentParser(prog="hyperfsdp bench")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args, ["hyperfsdp", "bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
