"""``hyperfsdp demo``: train a small transformer on N CPU ranks and check parity (placeholder wiring)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo", help="train a small sharded transformer on CPU ranks and check parity"
    )
    p.add_argument("--world-size", type=int, default=4, help="number of CPU ranks (default 4)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("demo: not wired yet")
