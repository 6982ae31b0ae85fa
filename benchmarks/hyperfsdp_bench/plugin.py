"""The benchmark suite as a hyperfsdp plugin: it adds the ``hyperfsdp bench`` command.

It implements ``hyperfsdp_cli_commands`` only, so it changes nothing in training. This
module stays cheap to import (the plugin manager imports it wherever hyperfsdp is, also in
the suite's own rank processes); the suite is imported when the command runs.
"""

from __future__ import annotations

import argparse

from hyperfsdp_core.plugin import hookimpl

#: The hyperfsdp plugin-API versions this plugin supports.
HYPERFSDP_API = ">=1.0,<2"


@hookimpl
def hyperfsdp_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    from .cli import add_parser

    add_parser(subparsers)
