"""``hyperfsdp ckpt inspect DIR``, ``hyperfsdp ckpt export DIR OUT`` and ``hyperfsdp ckpt verify DIR``."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    ckpt = subparsers.add_parser("ckpt", help="inspect and export DCP checkpoints (hyperfsdp-dcp)")
    ckpt.set_defaults(func=lambda args: (ckpt.print_help(), 2)[1])
    sub = ckpt.add_subparsers(dest="ckpt_command", metavar="ACTION")

    p = sub.add_parser(
        "inspect",
        help="tensors, global shapes, dtypes, chunks per rank, bytes, steps present",
        description="Describe a DCP checkpoint directory, or the newest complete step-N "
        "checkpoint of a CheckpointManager directory.",
    )
    p.add_argument("dir", help="a checkpoint directory or a manager directory of step-N ones")
    p.add_argument("--step", type=int, default=None, help="the step to inspect (manager directory)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_inspect)

    p = sub.add_parser(
        "export",
        help="write one full (unsharded) state-dict file: safetensors if installed, else torch.save",
        description="Gather a sharded checkpoint into one full state-dict file (no process "
        "group needed). By default the model section is exported under its state_dict() keys.",
    )
    p.add_argument("dir", help="a checkpoint directory or a manager directory of step-N ones")
    p.add_argument("out", help="the file to write")
    p.add_argument("--step", type=int, default=None, help="the step to export (manager directory)")
    p.add_argument(
        "--prefix",
        default=None,
        help="section to export, keys stripped of it (default: model; '' exports every tensor)",
    )
    p.add_argument(
        "--format",
        choices=("auto", "safetensors", "torch"),
        default="auto",
        help="auto: safetensors when installed, else torch.save",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_export)

    p = sub.add_parser(
        "verify",
        help="check a checkpoint's files (sizes, CRC-32 checksums) without loading it",
        description="Check that a checkpoint is intact without loading it: its metadata is "
        "readable, every data file is present and long enough, and every file matches the "
        "CRC-32 recorded at save (checksums.json). Given a manager directory, checks every "
        "step-N checkpoint (or --step N); one without .metadata is reported damaged. Exit "
        "status 1 when anything is damaged.",
    )
    p.add_argument("dir", help="a checkpoint directory or a manager directory of step-N ones")
    p.add_argument("--step", type=int, default=None, help="the step to check (manager directory)")
    p.set_defaults(func=_verify)


def _inspect(args: argparse.Namespace) -> int:
    from ._inspect import format_info, inspect_checkpoint
    from ._io import CheckpointLoadError

    try:
        info = inspect_checkpoint(args.dir, args.step)
    except CheckpointLoadError as exc:
        print(f"hyperfsdp ckpt inspect: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(info.as_dict(), indent=1) if args.json else format_info(info))
    return 0


def _export(args: argparse.Namespace) -> int:
    from ._inspect import export_checkpoint
    from ._io import CheckpointLoadError

    try:
        out, fmt, n = export_checkpoint(
            args.dir,
            args.out,
            step=args.step,
            prefix=args.prefix,
            fmt=args.format,
            progress=not args.no_progress,
        )
    except (CheckpointLoadError, ImportError, ValueError) as exc:
        print(f"hyperfsdp ckpt export: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {n} tensors to {out} ({fmt})")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ._inspect import verify_checkpoint
    from ._io import CheckpointLoadError, is_complete, list_checkpoints

    root = Path(args.dir)
    try:
        listing = list_checkpoints(root)
        steps = {**listing.complete, **listing.damaged}  # damaged: step-N without .metadata
        if args.step is None and not is_complete(root) and steps:
            results = [verify_checkpoint(steps[s]) for s in sorted(steps, reverse=True)]
        else:
            results = [verify_checkpoint(root, args.step)]
    except CheckpointLoadError as exc:
        print(f"hyperfsdp ckpt verify: {exc}", file=sys.stderr)
        return 1
    for result in results:
        print(result)
    return 0 if all(r.ok for r in results) else 1
