"""The ``hyperfsdp`` command (also ``python -m hyperfsdp_core``)."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence


def _cmd_plugins(args: argparse.Namespace) -> int:
    from ._plugins import (
        API_ATTRIBUTE,
        DISABLE_AUTOLOAD_ENV,
        PluginLoadError,
        _version,
        api_version_string,
        get_plugin_manager,
    )

    try:
        pm = get_plugin_manager()
    except PluginLoadError as exc:
        print(f"hyperfsdp plugins: {exc}", file=sys.stderr)
        return 1
    infos = pm.plugin_infos()
    width = max(len(i.name) for i in infos)
    dwidth = max(len(i.distribution) for i in infos)
    vwidth = max(len(i.version) for i in infos)
    print(f"hyperfsdp {_version('hyperfsdp')}, plugin API {api_version_string()}")
    print("installed plugins (name, distribution, version, plugin API supported):")
    for info in infos:
        spec = str(getattr(pm.get_plugin(info.name), API_ATTRIBUTE, "-")).replace(" ", "")
        print(
            f"  {info.name.ljust(width)}  {info.distribution.ljust(dwidth)}  "
            f"{info.version.ljust(vwidth)}  {spec}"
        )
    if not pm.autoloaded:
        print(f"  (entry-point plugins not loaded: {DISABLE_AUTOLOAD_ENV} is set)")
    print("finalization order (run by the root after every backward):")
    owners = pm.phase_owners()
    for i, phase in enumerate(pm.finalization_phases(), 1):
        print(f"  {i}. {phase.name}  ({owners.get(phase.name, '?')})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyperfsdp",
        description="hyperfsdp: fully sharded data parallelism for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("plugins", help="list installed plugins and the finalization order")
    p.set_defaults(func=_cmd_plugins)
    from . import _planning, bench, demo

    _planning.add_parser(sub)
    demo.add_parser(sub)
    if bench.available():  # the suite ships with the source checkout, not the wheel
        bench.add_parser(sub)
    _plugin_commands(sub)
    return parser


def _plugin_commands(sub) -> None:
    """Commands contributed by plugins (``hyperfsdp_cli_commands``)."""
    from ._plugins import PluginLoadError, get_plugin_manager

    try:
        pm = get_plugin_manager()
    except PluginLoadError:
        return  # `hyperfsdp plugins` reports the broken plugin
    pm.hook.hyperfsdp_cli_commands(subparsers=sub)


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
