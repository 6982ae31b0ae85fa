"""The core's layers import one way: no back edge and no cycle, at any level.

Every import counts: at module level, under ``if TYPE_CHECKING:``, and inside a function
(a deferred import still ties two modules together). Layers, lowest first::

    0  policies, _torch_private     leaves: user-facing records, torch internals
    1  comm                         how bytes move (the only layer calling collectives)
    2  engine                       parameters, buckets, reductions, the hook state machine
    3  plugin                       the public plugin API, hookspecs, manager, views, dispatch
    4  api, module, state_dict,     fully_shard, FSDPModule, state-dict hooks, replaced
       retired, drop_in, the        parameters, use_as_fsdp2, the top-level names
       package
    5  cli, testing, __main__       the command, the test harness

A module may import modules of a lower layer freely, and modules of its own layer
as long as no cycle forms. The checks run on the real package and on synthetic ones, so
each kind of violation is shown to fail.
"""

from __future__ import annotations

import ast
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = "hyperfsdp_core"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

#: module (dotted, relative to the package; a prefix names a sub-package) -> layer
LAYERS: dict[str, int] = {
    "policies": 0,
    "_torch_private": 0,
    "comm": 1,
    "engine": 2,
    "plugin": 3,
    "api": 4,
    "module": 4,
    "state_dict": 4,
    "retired": 4,
    "drop_in": 4,
    "": 4,  # the package's __init__: the public names
    "cli": 5,
    "testing": 5,
    "__main__": 5,
}
#: Calls that move bytes between ranks; only ``comm`` (and user-level code: the demo,
#: the test harness) may make them.
COLLECTIVE = re.compile(
    r"\bdist\.(all_gather\w*|reduce_scatter\w*|all_reduce|broadcast|all_to_all\w*|"
    r"send|recv|isend|irecv|gather|scatter|reduce)\("
)
MAY_CALL_COLLECTIVES = {"comm", "cli", "testing"}


def layer_of(module: str) -> int:
    """The layer of ``module`` (relative dotted name): its longest prefix in :data:`LAYERS`."""
    if not module:
        return LAYERS[""]
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(module)


def _resolve(
    module: str, is_package: bool, node: ast.ImportFrom | ast.Import, known: set[str]
) -> list[str]:
    """The package-relative modules ``node`` imports (``""``: the package itself):
    ``from pkg import sub`` imports the module ``pkg.sub``, ``from pkg import name`` ``pkg``."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if module else []
            if not is_package:
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join([PACKAGE, *base, *([node.module] if node.module else [])])
        else:
            target = node.module or ""
        names = [f"{target}.{a.name}" for a in node.names]
    out = []
    for name in names:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            rel = name[len(PACKAGE) + 1 :]
            while rel not in known and "." in rel:
                rel = rel.rsplit(".", 1)[0]  # a name inside a module
            if rel not in known:
                rel = ""  # a name of the package itself
            out.append(rel)
    return out


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """``{module: (source, is_package)}`` -> ``{module: modules it imports}``, every import
    counted (module level, ``TYPE_CHECKING``, inside functions)."""
    known = set(sources)
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, (text, is_package) in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(module, is_package, node, known):
                    if target != module:
                        graph[module].add(target)
    return graph


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Back edges (an import of a higher layer) and import cycles, as messages."""
    graph = import_graph(sources)
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                found.append(
                    f"back edge: {module or PACKAGE} (layer {layer_of(module)}) imports "
                    f"{target or PACKAGE} (layer {layer_of(target)})"
                )
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        found.append("cycle: " + " -> ".join(m or PACKAGE for m in exc.args[1]))
    return found


def package_sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    sources = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        sources[".".join(parts)] = (path.read_text(), is_package)
    return sources


SOURCES = package_sources()


def test_every_module_has_a_layer():
    for module in SOURCES:
        layer_of(module)  # raises KeyError for a module outside every layer


def test_the_core_imports_one_way_without_cycles():
    assert violations(SOURCES) == []


def test_only_comm_calls_collectives():
    offenders = [
        module
        for module, (text, _) in SOURCES.items()
        if module.split(".")[0] not in MAY_CALL_COLLECTIVES and COLLECTIVE.search(text)
    ]
    assert offenders == []


def test_the_engine_never_names_the_plugin_layer():
    """Not even in a string or a comment-free annotation: the engine reaches plugins only
    through the port (``engine/port.py``) that ``fully_shard`` hands it."""
    for module, (text, _) in SOURCES.items():
        if module.split(".")[0] in ("comm", "engine"):
            assert "hyperfsdp_core.plugin" not in text and "..plugin" not in text, module


# -- the checker fails where it must (synthetic packages) ---------------------------------------

ENGINE = "from ..comm import Comm\n"
PLUGIN = "from ..engine.state import UnitState\n"


def _with(extra: dict[str, str]) -> dict[str, tuple[str, bool]]:
    base = {
        "comm": ("", True),
        "comm.collectives": ("", False),
        "engine": ("", True),
        "engine.state": (ENGINE, False),
        "plugin": ("", True),
        "plugin.views": (PLUGIN, False),
    }
    base.update({m: (text, False) for m, text in extra.items()})
    return base


def test_a_clean_synthetic_package_passes():
    assert violations(_with({})) == []


@pytest.mark.parametrize(
    "text",
    [
        "from ..plugin.views import ParamView\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..plugin import views\n",
        "def f():\n    from ..plugin.views import ParamView\n    return ParamView\n",
        "import hyperfsdp_core.plugin.views\n",
    ],
    ids=["module-level", "type-checking", "in-a-function", "absolute"],
)
def test_a_back_edge_fails(text):
    found = violations(_with({"engine.synthetic": text}))
    assert found and all(
        re.fullmatch(r"back edge: engine\.synthetic \(layer 2\) imports plugin\S* \(layer 3\)", f)
        for f in found
    ), found


def test_a_cycle_within_a_layer_fails():
    found = violations(
        _with(
            {
                "engine.a": "from . import b\n",
                "engine.b": "def f():\n    from .a import x\n",
            }
        )
    )
    assert len(found) == 1 and found[0].startswith("cycle: engine.")
    assert "engine.a" in found[0] and "engine.b" in found[0]


def test_a_module_outside_every_layer_is_named():
    with pytest.raises(KeyError):
        layer_of("bench")
    assert layer_of("engine.state") == 2 and layer_of("") == 4


# -- state you can read: a class's fields are written by its own module -------------------------

#: (module, attribute): writes the check cannot tell from a foreign field, with the reason
NOT_FIELDS = {
    ("engine.mesh_info", "world"): "a threading.local of its own",
}


def _own_fields(tree: ast.AST) -> set[str]:
    """Fields the classes of a module define: ``self.x = ...`` in their methods, ``__slots__``."""
    fields: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if (
                        isinstance(e, ast.Attribute)
                        and isinstance(e.value, ast.Name)
                        and e.value.id == "self"
                    ):
                        fields.add(e.attr)
                if isinstance(t, ast.Name) and t.id == "__slots__":
                    fields |= {
                        c.value
                        for c in ast.walk(node.value)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    }
    return fields


def foreign_writes(sources: dict[str, tuple[str, bool]], scope: tuple[str, ...]) -> list[str]:
    """Assignments in ``scope``'s modules to a field that only classes of *other* modules
    define (``obj.field = ...`` where ``obj`` is not ``self``)."""
    trees = {m: ast.parse(text) for m, (text, _) in sources.items() if m.split(".")[0] in scope}
    owners: dict[str, set[str]] = {}
    for module, tree in trees.items():
        for field in _own_fields(tree):
            owners.setdefault(field, set()).add(module)
    found = []
    for module, tree in sorted(trees.items()):
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if not isinstance(e, ast.Attribute):
                        continue
                    if isinstance(e.value, ast.Name) and e.value.id == "self":
                        continue
                    where = owners.get(e.attr, set())
                    if where and module not in where and (module, e.attr) not in NOT_FIELDS:
                        found.append(
                            f"{module}:{node.lineno} writes {ast.unparse(e)} "
                            f"(a field of {', '.join(sorted(where))})"
                        )
    return found


def test_no_field_is_written_by_another_module():
    """No module of the core changes another module's objects but through their methods
    (``Bucket.configure``, ``UnitState.set_options``, ``UnitState.use_comm``,
    ``ShardedParam.rename``...): the whole package, the top layer and the test harness too."""
    scope = tuple(sorted({module.split(".")[0] for module in SOURCES if module}))
    assert foreign_writes(SOURCES, scope) == []


def test_a_foreign_write_fails():
    sources = {
        "engine": ("", True),
        "engine.bucket": (
            "class Bucket:\n    def __init__(self):\n        self.state = 1\n",
            False,
        ),
        "engine.unit_params": ("def f(bucket):\n    bucket.state = 2\n", False),
    }
    assert foreign_writes(sources, ("engine",)) == [
        "engine.unit_params:2 writes bucket.state (a field of engine.bucket)"
    ]


# -- private torch names only in the _torch_private modules ---------------------------------------

#: attributes of torch objects that are private, which no torch module path shows
PRIVATE_TORCH_ATTRS = {"_cdata", "_local_tensor", "_spec", "_swap_data_ptr_", "_execution_engine"}


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_torch_names(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """``module:line name`` for every private torch name used outside a ``_torch_private``
    module: a private module or name imported from torch (``torch.utils._pytree``), a
    private attribute reached through a torch module (``torch._foreach_copy_``, through any
    alias such as ``dist``), and private attributes of torch objects (``._cdata``,
    ``getattr(t, "_local_tensor")``)."""
    found = []
    for module, (text, _) in sources.items():
        if module.split(".")[-1] == "_torch_private":
            continue
        tree = ast.parse(text)
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "torch":
                        aliases[a.asname or "torch"] = a.name if a.asname else "torch"
                        if any(map(_is_private, a.name.split("."))):
                            found.append(f"{module}:{node.lineno} {a.name}")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] != "torch":
                    continue
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    aliases[a.asname or a.name] = full
                    if any(map(_is_private, full.split("."))):
                        found.append(f"{module}:{node.lineno} {full}")
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute):
                chain = _dotted(node)
                if chain and chain[0] in aliases:
                    full = [*aliases[chain[0]].split("."), *chain[1:]]
                    if any(map(_is_private, full)):
                        name = ".".join(full)
                elif node.attr in PRIVATE_TORCH_ATTRS:
                    name = "." + node.attr
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in PRIVATE_TORCH_ATTRS
            ):
                name = node.args[1].value
            if name is not None:
                found.append(f"{module}:{node.lineno} {name}")
    return sorted(set(found))


def test_private_torch_names_only_in_torch_private_modules():
    assert private_torch_names(SOURCES) == []


@pytest.mark.parametrize(
    "text, name",
    [
        ("from torch.utils._pytree import tree_map\n", "torch.utils._pytree.tree_map"),
        ("import torch\ntorch._foreach_copy_([], [])\n", "torch._foreach_copy_"),
        (
            "import torch.distributed as dist\ndist._make_nccl_premul_sum\n",
            "torch.distributed._make_nccl_premul_sum",
        ),
        ("def f(t):\n    return t.untyped_storage()._cdata\n", "._cdata"),
        ("def f(t):\n    return getattr(t, '_local_tensor', None)\n", "_local_tensor"),
    ],
)
def test_a_private_torch_name_fails(text, name):
    sources = {"engine": ("", True), "engine.bucket": (text, False)}
    found = private_torch_names(sources)
    assert len(found) == 1 and found[0].endswith(" " + name), found
    sources["engine._torch_private"] = sources.pop("engine.bucket")  # its place: fine there
    assert private_torch_names(sources) == []
