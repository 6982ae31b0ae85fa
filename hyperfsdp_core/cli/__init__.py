"""The ``hyperfsdp`` command (also ``python -m hyperfsdp_core``)."""

from __future__ import annotations

import argparse
import sys
import textwrap
import warnings
from collections.abc import Sequence


def _cmd_plugins(args: argparse.Namespace) -> int:
    from ..plugin.manager import PluginSelectionError
    from ..plugin.versions import PluginLoadError

    try:
        pm, order_error = _load_plugin_manager()
    except (PluginLoadError, PluginSelectionError) as exc:
        print(f"hyperfsdp plugins: {exc}", file=sys.stderr)
        return 1
    _print_installed(pm)
    if order_error is not None:
        print("finalization order: cannot be resolved (see the error below)")
        _print_first_result_hooks(pm)
        _print_order_error(order_error)
        return 1
    print("finalization order (run by the root after every backward):")
    owners = pm.phase_owners()
    for i, phase in enumerate(pm.finalization_phases(), 1):
        print(f"  {i}. {phase.name}  ({owners.get(phase.name, '?')})")
    _print_first_result_hooks(pm)
    return 0


def _load_plugin_manager():
    """The plugin manager and ``None``; where the finalization phases cannot be ordered, an
    unsealed manager (to list what is installed) and that :class:`PhaseOrderError`. Plugins
    that fail to load or to be selected raise."""
    from ..plugin.manager import (
        PluginSelectionWarning,
        build_unsealed_plugin_manager,
        get_plugin_manager,
    )
    from ..plugin.phases import PhaseOrderError

    try:
        return get_plugin_manager(), None
    except PhaseOrderError as exc:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PluginSelectionWarning)  # main() reported them
            return build_unsealed_plugin_manager(), exc


def _print_installed(pm) -> None:
    """The versions, the installed plugins and the disabled ones."""
    from ..plugin.manager import DISABLE_AUTOLOAD_ENV, _version
    from ..plugin.versions import API_ATTRIBUTE, api_version_string

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
    if pm.disabled:
        print(f"disabled plugins (not loaded: {pm.disabled_by}):")
        dwidth = max(len(name) for name in pm.disabled)
        for name, info in pm.disabled.items():
            origin = (
                f"{info.distribution} {info.version}"
                if info is not None
                else "(no installed plugin has this name)"
            )
            print(f"  {name.ljust(dwidth)}  {origin}")


def _print_order_error(error: Exception) -> None:
    """Why the finalization phases cannot be ordered (stderr)."""
    print(
        "hyperfsdp plugins: error: the plugins' finalization phases cannot be ordered; "
        "every fully_shard call in this environment raises this until it is fixed:",
        file=sys.stderr,
    )
    wrapped = textwrap.fill(
        str(error),
        width=96,
        initial_indent="  ",
        subsequent_indent="  ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    print(wrapped, file=sys.stderr)


def _print_first_result_hooks(pm) -> None:
    print("first-result hooks (asked in this order; the first answer that is not None wins):")
    hooks = pm.first_result_hooks()
    hwidth = max(len(hook) for hook in hooks)
    for hook, impls in hooks.items():
        listing = ", ".join(f"{name} [{kind}]" if kind else name for name, kind in impls)
        print(f"  {hook.ljust(hwidth)}  {listing or '-'}")
    for hook, names in pm.first_result_conflicts().items():
        print(f"  note: {len(names)} plugins answer {hook}: {', then '.join(names)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyperfsdp",
        description="hyperfsdp: fully sharded data parallelism for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("plugins", help="list installed plugins and the finalization order")
    p.set_defaults(func=_cmd_plugins)
    from . import demo
    from . import plan as _planning

    _planning.add_parser(sub)
    demo.add_parser(sub)
    _plugin_commands(sub)
    return parser


def _plugin_commands(sub) -> None:
    """Commands contributed by plugins (``hyperfsdp_cli_commands``)."""
    from ..plugin.manager import PluginSelectionError, get_plugin_manager
    from ..plugin.phases import PhaseOrderError
    from ..plugin.versions import PluginLoadError

    try:
        pm = get_plugin_manager()
    except (PluginLoadError, PluginSelectionError, PhaseOrderError):
        return  # `hyperfsdp plugins` reports it
    pm.hook.hyperfsdp_cli_commands(subparsers=sub)


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    from ..plugin.manager import PluginSelectionWarning

    with warnings.catch_warnings(record=True) as caught:
        parser = build_parser()  # builds the plugin manager (for plugins' commands)
    for w in caught:
        if issubclass(w.category, PluginSelectionWarning):
            print(f"hyperfsdp: warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
