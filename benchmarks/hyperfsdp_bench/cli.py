"""``hyperfsdp bench``: hyperfsdp vs torch FSDP2 vs DDP vs a compute-only floor, side by side.

This package (``hyperfsdp-bench``, the checkout's ``benchmarks/`` folder) adds the command
through the ``hyperfsdp_cli_commands`` hook, as any plugin adds its commands (see
:mod:`hyperfsdp_bench.plugin`); the core knows nothing of it. Install it with
``pip install -e benchmarks`` (``make install`` does). See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from . import names

#: the ``benchmarks/`` folder when this package is installed from the checkout (editable)
_CHECKOUT = Path(__file__).resolve().parent.parent


def results_dir() -> Path:
    """Where results go by default: ``benchmarks/results`` in a checkout (editable
    install), else ``hyperfsdp-bench-results`` in the working directory."""
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "run.py").is_file():
        return _CHECKOUT / "results"
    return Path.cwd() / "hyperfsdp-bench-results"


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
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
        "with gloo's own all-gather and reduce-scatter; hyperfsdp-core the core alone, "
        "without the shared-memory plugin (HYPERFSDP_SHM=0); <impl>-foreach that implementation "
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
        help="where to write the results (default benchmarks/results/latest.json in the "
        "checkout, else ./hyperfsdp-bench-results/latest.json)",
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
        help="draw PNG charts into DIR (needs matplotlib: pip install -e 'benchmarks[charts]'): "
        "the "
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
    from .cases import PRESETS, select_cases
    from .suite import Options
    from .suite import run as run_suite

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
        json_path=args.json_path or results_dir() / "latest.json",
        markdown_path=args.markdown,
        timeline=args.timeline,
        charts_dir=args.charts,
    )
    if args.replot:
        from .suite import replot

        return replot(args.replot, opts)
    if args.list:
        for case in select_cases(PRESETS[opts.preset], opts.configs, opts.worlds, opts.layers):
            print(f"{case.name:24s} impls: {', '.join(case.impls(opts.impls))}")
        return 0
    run_suite(opts, argv if argv is not None else ["hyperfsdp", *sys.argv[1:]])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hyperfsdp_bench`` or ``python benchmarks/run.py`` (= ``hyperfsdp bench``)."""
    parser = argparse.ArgumentParser(prog="hyperfsdp bench")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args, ["hyperfsdp", "bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
