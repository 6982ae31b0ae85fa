"""The public plugin API holds: plugins use nothing else, and every hookspec documents itself.

Every Python file of a plugin (:data:`PLUGIN_SOURCES`: the distributions under
``plugins/*/`` and ``examples/*/``, sources and tests, and the core's own built-in plugins in
``hyperfsdp_core/plugin/builtin/``) may import from ``hyperfsdp_core`` only names in
``hyperfsdp_core.__all__``, the module ``hyperfsdp_core.plugin`` (names in its ``__all__``)
and ``hyperfsdp_core.testing``; it may not touch the engine's private attributes
(``module._hyperfsdp_state``, a view's ``_hyperfsdp_*`` slot, or any ``_name`` the core
defines and the plugin does not). Relative imports count as the absolute ones they stand
for; only those within the plugin's own package are free.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import hyperfsdp_core
from hyperfsdp_core import plugin
from hyperfsdp_core.plugin import hookspecs

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_MODULES = {
    "hyperfsdp_core": set(hyperfsdp_core.__all__),
    "hyperfsdp_core.plugin": set(plugin.__all__),
    "hyperfsdp_core.testing": None,  # the test harness: everything public in it
    "hyperfsdp_core.testing.counting": None,
    "hyperfsdp_core.testing.reference": None,
    "hyperfsdp_core.testing.streams": None,
    "hyperfsdp_core.cli": {"main"},  # the `hyperfsdp` command, for plugins' CLI tests
}
#: Where plugins live: a glob of their Python files -> the plugin's own package, against
#: which relative imports resolve (``None``: the distribution's own layout, where a relative
#: import cannot reach ``hyperfsdp_core``). One line per place.
PLUGIN_SOURCES = {
    "plugins/*/**/*.py": None,
    "examples/*/**/*.py": None,
    "hyperfsdp_core/plugin/builtin/**/*.py": "hyperfsdp_core.plugin.builtin",
}
#: Places that must hold files to check (a glob that silently matches nothing checks nothing).
EXPECTED_PLUGINS = {
    "plugins/hsdp",
    "plugins/qcomm",
    "plugins/shm",
    "examples/commlog",
    "hyperfsdp_core/plugin",
}
PLUGIN_FILES = sorted(
    (p, package)
    for pattern, package in PLUGIN_SOURCES.items()
    for p in ROOT.glob(pattern)
    if "build" not in p.parts
)
BUILTIN_DIRS = {
    ROOT.joinpath(*package.split(".")) for package in PLUGIN_SOURCES.values() if package is not None
}


def _core_private_names() -> frozenset[str]:
    """``_name`` attributes and methods the core defines (not dunders); the built-in plugins
    are plugins, not the core."""
    names = set()
    for path in (ROOT / "hyperfsdp_core").rglob("*.py"):
        if any(d in path.parents for d in BUILTIN_DIRS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.FunctionDef):
                names.add(node.name)
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.isidentifier()
            ):
                names.add(node.value)  # __slots__ entries
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__"))


CORE_PRIVATE = _core_private_names()


def _absolute(node: ast.ImportFrom, package: str | None, plugin_package: str | None) -> str | None:
    """The module a ``from`` import names, a relative one resolved against ``package`` (the
    file's package); ``None`` for one within ``plugin_package`` (free)."""
    if node.level == 0:
        return node.module
    if package is None:
        return None
    parts = package.split(".")
    if node.level > len(parts):
        raise ValueError(f"relative import beyond the top package {package!r}")
    module = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    plugin_package = plugin_package or package
    if module == plugin_package or module.startswith(plugin_package + "."):
        return None
    return module


def _package_of(path: Path) -> str:
    return ".".join(path.parent.relative_to(ROOT).parts)


def violations(
    source: str,
    filename: str = "<plugin>",
    package: str | None = None,
    plugin_package: str | None = None,
) -> list[str]:
    """Every use of a non-public core name in ``source``, as ``"line: what"``. ``package`` is
    the file's package where its relative imports can reach ``hyperfsdp_core`` (the built-in
    plugins), ``plugin_package`` the plugin's top package (default: ``package``)."""
    tree = ast.parse(source, filename=filename)
    own = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
    } | {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    aliases: dict[str, str] = {}  # local name -> public core module it stands for
    found = []

    def check_module(module: str, line: int) -> bool:
        if module != "hyperfsdp_core" and not module.startswith("hyperfsdp_core."):
            return True
        if module not in PUBLIC_MODULES:
            found.append(f"{line}: imports private module {module}")
            return False
        return True

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if check_module(alias.name, node.lineno) and alias.name in PUBLIC_MODULES:
                    aliases[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else "hyperfsdp_core"
                    )
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, package, plugin_package)
            if module is None or not check_module(module, node.lineno):
                continue
            public = PUBLIC_MODULES.get(module, ())
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if full in PUBLIC_MODULES:
                    aliases[alias.asname or alias.name] = full
                elif module in PUBLIC_MODULES and public is not None and alias.name not in public:
                    found.append(f"{node.lineno}: imports private name {full}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and base.id in aliases:
                module = aliases[base.id]
                public = PUBLIC_MODULES[module]
                full = f"{module}.{node.attr}"
                if public is not None and node.attr not in public and full not in PUBLIC_MODULES:
                    found.append(f"{node.lineno}: uses private name {full}")
            attr = node.attr
            if attr.startswith(("_hyperfsdp", "_fsdp_state")) or (
                attr in CORE_PRIVATE and attr not in own
            ):
                found.append(f"{node.lineno}: accesses core-private attribute .{attr}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("_hyperfsdp")
        ):
            found.append(f"{node.lineno}: names core-private attribute {node.value!r}")
    return sorted(found, key=lambda v: int(v.split(":")[0]))


def test_there_are_plugin_sources_to_check():
    places = {"/".join(p.relative_to(ROOT).parts[:2]) for p, _ in PLUGIN_FILES}
    assert places >= EXPECTED_PLUGINS


@pytest.mark.parametrize(
    ("path", "package"), PLUGIN_FILES, ids=[str(p.relative_to(ROOT)) for p, _ in PLUGIN_FILES]
)
def test_plugin_uses_only_the_public_api(path, package):
    file_package = _package_of(path) if package is not None else None
    assert violations(path.read_text(), str(path), file_package, package) == []


def test_the_checker_finds_every_kind_of_violation():
    source = """
import hyperfsdp_core._state
import hyperfsdp_core as hc
from hyperfsdp_core import _plugins
from hyperfsdp_core import fully_shard, FSDPModule
from hyperfsdp_core._group import Bucket
from hyperfsdp_core.plugin import hookimpl, Phase, _CLAUSE
from hyperfsdp_core import plugin as api

def f(model, unit, red):
    model._hyperfsdp_state.group
    model._fsdp_state()
    unit._hyperfsdp_state
    red._bucket
    getattr(model, "_hyperfsdp_state")
    hc._api
    api.Phase
    api.FIRST_PHASE
    api._views
    hc.fully_shard
"""
    assert violations(source) == [
        "2: imports private module hyperfsdp_core._state",
        "4: imports private name hyperfsdp_core._plugins",
        "6: imports private module hyperfsdp_core._group",
        "7: imports private name hyperfsdp_core.plugin._CLAUSE",
        "11: accesses core-private attribute ._hyperfsdp_state",
        "12: accesses core-private attribute ._fsdp_state",
        "13: accesses core-private attribute ._hyperfsdp_state",
        "14: accesses core-private attribute ._bucket",
        "15: names core-private attribute '_hyperfsdp_state'",
        "16: uses private name hyperfsdp_core._api",
        "19: uses private name hyperfsdp_core.plugin._views",
    ]


def test_the_checker_resolves_a_builtin_plugins_relative_imports():
    source = """
from .. import Phase, hookimpl
from .. import _CLAUSE
from ... import fully_shard, _views
from ...engine.root import RootContext
from . import mixed_precision
from .core import _drain
from ._helpers import helper
from ..views import UnitView

def f(root):
    root._hyperfsdp_ctx.drain_reductions()
"""
    assert violations(source, package="hyperfsdp_core.plugin.builtin") == [
        "3: imports private name hyperfsdp_core.plugin._CLAUSE",
        "4: imports private name hyperfsdp_core._views",
        "5: imports private module hyperfsdp_core.engine.root",
        "9: imports private module hyperfsdp_core.plugin.views",
        "12: accesses core-private attribute ._hyperfsdp_ctx",
    ]
    # a sub-package of a plugin reaches its plugin's modules, not the core's
    assert violations(
        "from ..core import _drain\nfrom ... import hookimpl\nfrom ....engine import state\n",
        package="hyperfsdp_core.plugin.builtin.sub",
        plugin_package="hyperfsdp_core.plugin.builtin",
    ) == ["3: imports private module hyperfsdp_core.engine"]
    # outside the core (a plugin distribution) relative imports stay within the plugin
    assert violations("from .._state import x\n") == []


def test_a_plugins_own_private_names_are_its_business():
    source = """
class Queue:
    def __init__(self):
        self._data = []
        self._holds = 0

    def push(self, x):
        self._data.append(x)
        return self._holds
"""
    assert "_holds" in CORE_PRIVATE  # the core's Reduction has one too
    assert violations(source) == []


def test_public_plugin_module_exports_exist_and_are_documented():
    for name in plugin.__all__:
        obj = getattr(plugin, name)
        if callable(obj) and not isinstance(obj, type) and name != "hookimpl":
            assert obj.__doc__, f"hyperfsdp_core.plugin.{name} has no docstring"
        if isinstance(obj, type):
            assert obj.__doc__, f"hyperfsdp_core.plugin.{name} has no docstring"


HOOKSPECS = {
    name: fn
    for name, fn in vars(hookspecs).items()
    if name.startswith("hyperfsdp_") and hasattr(fn, "hyperfsdp_spec")
}


@pytest.mark.parametrize("name", sorted(HOOKSPECS))
def test_hookspec_documents_every_parameter_and_its_return(name):
    fn = HOOKSPECS[name]
    doc = inspect.getdoc(fn) or ""
    for param in inspect.signature(fn).parameters:
        assert f":param {param}:" in doc, f"{name}: :param {param}: missing"
    assert ":returns:" in doc, f"{name}: :returns: missing"
    first_result = fn.hyperfsdp_spec.get("firstresult", False)
    assert ("*First result.*" in doc) == first_result, f"{name}: say whether it is first-result"
    hints = inspect.signature(fn)
    assert hints.return_annotation is not inspect.Signature.empty
    for param in hints.parameters.values():
        assert param.annotation is not inspect.Parameter.empty, f"{name}({param.name}) untyped"


def test_hookspec_signatures_name_only_public_types():
    """Annotations in hookspecs.py refer to public types (``plugin.__all__``, torch, stdlib)."""
    private_types = {
        "FSDPState",
        "ParamGroup",
        "Bucket",
        "HSDPParam",
        "RootContext",
        "Comm",
    }
    text = (ROOT / "hyperfsdp_core" / "plugin" / "hookspecs.py").read_text()
    body = text.split("hookspec = pluggy.HookspecMarker", 1)[1]
    used = {t for t in private_types if re.search(rf"\b{t}\b", body)}  # not CommDebugMode
    assert used == set()
    for name in ("UnitSpec", "UnitView", "ParamView", "RootView", "MeshInfo", "Reduction"):
        assert name in plugin.__all__


def test_top_level_names_are_the_contracts():
    """``hyperfsdp_core``'s public names are exactly those the API contract lists."""
    assert set(hyperfsdp_core.__all__) == {
        "CPUOffloadPolicy",
        "DataParallelMeshDims",
        "FSDPModule",
        "MixedPrecisionPolicy",
        "OffloadPolicy",
        "UnshardHandle",
        "fully_shard",
        "get_plugin_manager",
        "hookimpl",
        "register_fsdp_forward_method",
        "share_comm_ctx",
        "use_as_fsdp2",
    }
    for name in hyperfsdp_core.__all__:
        assert getattr(hyperfsdp_core, name) is not None
    assert callable(hyperfsdp_core.use_as_fsdp2)
