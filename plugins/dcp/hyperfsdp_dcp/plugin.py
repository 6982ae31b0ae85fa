"""The dcp plugin: the ``hyperfsdp ckpt`` commands.

Checkpointing itself needs no hook: hyperfsdp parameters are DTensors holding only each
rank's actual rows, so ``torch.distributed.checkpoint`` saves and reshards them as they
are, and the core rebuilds its padded communication storage after every
``load_state_dict``. The library lives in :mod:`hyperfsdp_dcp`; this module stays cheap to
import (it is imported wherever hyperfsdp is).
"""

from __future__ import annotations

import argparse

from hyperfsdp_core.plugin import hookimpl

#: The hyperfsdp plugin-API versions this plugin supports.
HYPERFSDP_API = ">=1.1,<2"  # group_timeout


@hookimpl
def hyperfsdp_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    from ._cli import add_parser

    add_parser(subparsers)
