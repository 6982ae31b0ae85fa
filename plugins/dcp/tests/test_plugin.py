"""The plugin as the core sees it: discovery, API range, CLI hook, public names only."""

import ast
import re
from pathlib import Path

import hyperfsdp_dcp
from hyperfsdp_dcp import plugin

from hyperfsdp_core import get_plugin_manager

ROOT = Path(__file__).resolve().parents[1]


def test_discovered_through_its_entry_point():
    pm = get_plugin_manager()
    assert pm.get_plugin("dcp") is plugin
    impls = [i.plugin for i in pm.hook.hyperfsdp_cli_commands.get_hookimpls()]
    assert plugin in impls


def test_declares_the_plugin_api_range():
    assert plugin.HYPERFSDP_API == ">=1.0,<2"
    assert all(
        re.fullmatch(r"(>=|<|<=|>|==)\d+(\.\d+)*", s) for s in plugin.HYPERFSDP_API.split(",")
    )


def test_public_names_are_documented():
    for name in hyperfsdp_dcp.__all__:
        obj = getattr(hyperfsdp_dcp, name)
        assert obj.__doc__ and obj.__doc__.strip(), name


def _core_references(path: Path) -> list[str]:
    """Imports of, and attribute reads into, non-public hyperfsdp_core names."""
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    core_aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hyperfsdp_core"):
                    core_aliases.add(alias.asname or alias.name.split(".")[0])
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        bad.append(f"{path.name}:{node.lineno} import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hyperfsdp_core"):
            parts = node.module.split(".")
            names = [a.name for a in node.names]
            if any(p.startswith("_") for p in parts) or any(n.startswith("_") for n in names):
                bad.append(f"{path.name}:{node.lineno} from {node.module} import {names}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_hyperfsdp"):
            bad.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and isinstance(node.value, ast.Name)
            and node.value.id in core_aliases
        ):
            bad.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return bad


def test_uses_only_public_core_names():
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 10
    bad = [b for f in files for b in _core_references(f)]
    assert not bad, bad
