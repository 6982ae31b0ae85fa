"""Every hook is documented in docs/plugin_hooks.md and has a ``test_hook_*`` test (datasette's rule)."""

from __future__ import annotations

import ast
import functools
import inspect
import re
import types
from pathlib import Path

import pytest

from hyperfsdp_core import hookspecs
from hyperfsdp_core._plugins import build_plugin_manager

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
