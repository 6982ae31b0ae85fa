"""Every hook is documented in docs/plugin_hooks.md and has a ``test_hook_*`` test (datasette's rule)."""

from __future__ import annotations

import ast
import functools
import inspect
import re
import types
from pathlib import Path

import pytest

from hyperfsdp_core.plugin import hookspecs
from hyperfsdp_core.plugin.manager import build_plugin_manager

ROOT = Path(__file__).resolve().parent.parent
HOOKS_DOC = ROOT / "docs" / "plugin_hooks.md"
PREFIX = "hyperfsdp_"


def hookspec_functions() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(hookspecs).items()
        if name.startswith(PREFIX) and hasattr(fn, "hyperfsdp_spec")
    }


HOOKS = hookspec_functions()


def heading_for(name: str) -> str:
    return f"{name}({', '.join(HOOKS[name].parameters)})"


def doc_sections() -> dict[str, str]:
    """Hook name -> the text of its section (heading ``### name(params)`` to the next heading)."""
    text = HOOKS_DOC.read_text()
    headings = list(re.finditer(r"^(#{2,4}) (.+)$", text, re.MULTILINE))
    sections = {}
    for i, match in enumerate(headings):
        title = match[2].strip().strip("`")
        hook = re.match(rf"({PREFIX}\w+)\(", title)
        if hook is None:
            continue
        end = headings[i + 1].start() if i + 1 < len(headings) else len(text)
        sections[hook[1]] = (title, text[match.end() : end])
    return sections


SECTIONS = doc_sections()


def test_there_are_hooks_to_check():
    # Guards the parametrized tests below against silently checking nothing.
    assert len(HOOKS) >= 9
    assert "hyperfsdp_finalize_phases" in HOOKS


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_hook_is_documented_under_its_exact_signature(hook):
    assert hook in SECTIONS, f"{hook} has no section in {HOOKS_DOC.relative_to(ROOT)}"
    title, _ = SECTIONS[hook]
    assert title == heading_for(hook), f"heading {title!r} should be {heading_for(hook)!r}"


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_hook_section_has_parameters_timing_example_and_use_cases(hook):
    _, body = SECTIONS[hook]
    for param in HOOKS[hook].parameters:
        assert f"`{param}`" in body, f"{hook}: parameter {param!r} is not described"
    for part in ("**When it runs**", "**Example**", "**Use cases**"):
        assert part in body, f"{hook}: section lacks {part}"
    assert "@hookimpl" in example_of(hook)
    assert f"def {hook}(" in example_of(hook)


def example_of(hook: str) -> str:
    _, body = SECTIONS[hook]
    blocks = re.findall(r"```python\n(.*?)```", body, re.DOTALL)
    assert blocks, f"{hook}: no ```python example"
    return blocks[0]


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_hook_example_registers_as_a_plugin(hook):
    """The example runs and is a valid plugin: pluggy checks the hook name and arguments."""
    module = types.ModuleType(f"plugin_hooks_example_{hook}")
    exec(compile(example_of(hook), f"<{HOOKS_DOC.name}: {hook}>", "exec"), module.__dict__)
    pm = build_plugin_manager(autoload=False)
    pm.register(module, name=module.__name__)
    implementers = [impl.plugin for impl in getattr(pm.hook, hook).get_hookimpls()]
    assert module in implementers


def test_no_documented_hook_is_stale():
    stale = sorted(set(SECTIONS) - set(HOOKS))
    assert not stale, f"documented but not in hookspecs.py: {stale}"


@functools.cache
def functions_defined_under_tests() -> frozenset[str]:
    names = set()
    for path in sorted(ROOT.glob("tests/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
    return frozenset(names)


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_hook_has_a_test(hook):
    expected = f"test_hook_{hook.removeprefix(PREFIX)}"
    assert expected in functions_defined_under_tests(), (
        f"no test function named {expected} under tests/"
    )


# -- the plugin pages beyond the hooks: paths, PluginComm, wrappers, `hyperfsdp plugins` ----------

PLUGIN_DOCS = [ROOT / "README.md", ROOT / "docs" / "plugins.md", HOOKS_DOC]


@pytest.mark.parametrize(
    "doc", [*PLUGIN_DOCS, ROOT / "docs" / "mixed-precision.md"], ids=lambda p: p.name
)
def test_repository_paths_in_plugin_docs_exist(doc):
    paths = set(re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|md|toml))`", doc.read_text()))
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not (doc.parent / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


def _documented_signature(method) -> str:
    """``name(a, b, op=ReduceOp.SUM, *, unit=None) -> Work``, as the doc writes it."""
    parts, star = [], False
    for param in list(inspect.signature(method).parameters.values())[1:]:
        if param.kind is param.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if param.default is param.empty:
            parts.append(param.name)
        else:
            default = param.default
            text = f"ReduceOp.{default.name}" if hasattr(default, "name") else repr(default)
            parts.append(f"{param.name}={text}")
    return f"{method.__name__}({', '.join(parts)}) -> Work"


def test_plugin_comm_methods_are_documented_with_their_signatures():
    from hyperfsdp_core.plugin import PluginComm

    text = " ".join(HOOKS_DOC.read_text().split())  # line breaks inside a signature
    methods = [
        getattr(PluginComm, name)
        for name in vars(PluginComm)
        if not name.startswith("_") and inspect.isfunction(getattr(PluginComm, name))
    ]
    assert {m.__name__ for m in methods} == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
    }
    for method in methods:
        assert f"`{_documented_signature(method)}`" in text, _documented_signature(method)
    assert "`device` (property)" in text


def _section(doc: Path, heading: str) -> str:
    text = doc.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_hook_wrapper_example_adjusts_the_winning_answer():
    import torch
    from torch import nn

    block = re.findall(r"```python\n(.*?)```", _section(HOOKS_DOC, "Hook wrappers"), re.DOTALL)
    module = types.ModuleType("plugin_hooks_wrapper_example")
    exec(compile(block[0], f"<{HOOKS_DOC.name}: wrapper>", "exec"), module.__dict__)
    pm = build_plugin_manager(autoload=False)
    pm.register(module, name="wrapper_example")
    assert pm.first_result_hooks()["hyperfsdp_param_dtypes"][0] == ("wrapper_example", "wrapper")
    param = nn.Parameter(torch.zeros(2))
    policy = types.SimpleNamespace(param_dtype=torch.bfloat16, reduce_dtype=None)
    unit = types.SimpleNamespace(mp_policy=policy)
    hook = pm.hook.hyperfsdp_param_dtypes
    # the builtin mixed-precision plugin answers (bf16, bf16); the wrapper changes the reduce dtype
    assert hook(unit=unit, param=param) == (torch.bfloat16, torch.float32)
    unit.mp_policy = types.SimpleNamespace(param_dtype=None, reduce_dtype=None)
    assert hook(unit=unit, param=param) is None


def _console_output(doc: Path, command: str = "hyperfsdp plugins") -> list[str]:
    """The lines a ```console block shows after ``$ <command>``."""
    for block in re.findall(r"```console\n(.*?)```", doc.read_text(), re.DOTALL):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.startswith(f"$ {command}"):
                return [out for out in lines[i + 1 :] if not out.startswith("$ ")]
    raise AssertionError(f"{doc.relative_to(ROOT)} shows no `$ {command}` output")


@pytest.mark.parametrize("doc", PLUGIN_DOCS[:2], ids=lambda p: p.name)
def test_documented_plugins_output_is_the_real_output(doc, monkeypatch, capsys):
    """The ``hyperfsdp plugins`` output pasted in the docs is this environment's (the dev
    environment of ``make install``, with every plugin of the repository installed)."""
    from hyperfsdp_core.cli import main
    from hyperfsdp_core.plugin import manager as _plugins

    monkeypatch.delenv(_plugins.PLUGINS_DISABLE_ENV, raising=False)
    monkeypatch.delenv(_plugins.DISABLE_AUTOLOAD_ENV, raising=False)
    monkeypatch.setattr(_plugins, "_manager", None)  # a fresh manager, restored afterwards
    assert main(["plugins"]) == 0
    real = capsys.readouterr().out.splitlines()
    assert _console_output(doc) == real, "paste the output of a real `hyperfsdp plugins` run"


def test_the_plugin_guides_pyproject_is_the_examples_whole_file():
    """docs/plugins.md shows examples/commlog/pyproject.toml as it is (build system and
    package configuration included): a plugin author can copy it and build."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    block = re.search(r"```toml\n# examples/commlog/pyproject.toml\n(.*?)```", text, re.DOTALL)
    assert block is not None
    assert block.group(1) == (ROOT / "examples" / "commlog" / "pyproject.toml").read_text()
