"""The ``hyperfsdp`` command: ``plugins`` and ``--help``."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

from hyperfsdp_core import hookimpl
from hyperfsdp_core.cli import main
from hyperfsdp_core.plugin.manager import (
    DISABLE_AUTOLOAD_ENV,
    PLUGINS_DISABLE_ENV,
    get_plugin_manager,
)
from hyperfsdp_core.plugin.phases import FIRST_PHASE, Phase

VERSION = importlib.metadata.version("hyperfsdp")
BUILTINS = ("hyperfsdp.core", "hyperfsdp.mixed_precision")


def plugin_rows(out: str, with_api: bool = False) -> dict[str, tuple[str, ...]]:
    """``name -> (distribution, version[, API range])`` from the installed-plugins section."""
    section = out.split("installed plugins", 1)[1].split("finalization order", 1)[0]
    rows = {}
    for line in section.splitlines()[1:]:
        parts = line.split()
        if len(parts) == 4 and not line.lstrip().startswith("("):
            rows[parts[0]] = tuple(parts[1:]) if with_api else (parts[1], parts[2])
    return rows


def phase_rows(out: str) -> list[tuple[int, str, str]]:
    """``(position, phase, plugin)`` from the finalization-order section."""
    section = out.split("finalization order", 1)[1]
    return [
        (int(m[1]), m[2], m[3])
        for m in re.finditer(r"^\s+(\d+)\. (\S+)\s+\((.+)\)$", section, re.MULTILINE)
    ]


def test_plugins_lists_builtins_with_distribution_and_version(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    rows = plugin_rows(out)
    for name in BUILTINS:
        assert rows[name] == ("hyperfsdp", VERSION)
    assert out.startswith(f"hyperfsdp {VERSION}, plugin API 1.2\n")
    assert plugin_rows(out, with_api=True)["hsdp"] == ("hyperfsdp-hsdp", VERSION, ">=1.0,<2")
    pm = get_plugin_manager()
    assert set(rows) == {info.name for info in pm.plugin_infos()}
    phases = phase_rows(out)
    expected = [p.name for p in pm.finalization_phases()]
    assert [name for _, name, _ in phases] == expected
    assert [pos for pos, _, _ in phases] == list(range(1, len(expected) + 1))
    assert phases[0] == (1, FIRST_PHASE, "hyperfsdp.core")


class _ThirdParty:
    @hookimpl
    def hyperfsdp_finalize_phases(self):
        return [
            Phase("zz.cli_test_late", lambda ctx: None, after="aa.cli_test_early"),
            Phase("aa.cli_test_early", lambda ctx: None, after=FIRST_PHASE),
        ]


def test_plugins_shows_a_registered_plugin_and_its_phases_in_order(capsys):
    pm = get_plugin_manager()
    plugin = _ThirdParty()
    pm.register(plugin, name="cli_test_plugin")
    try:
        assert main(["plugins"]) == 0
        out = capsys.readouterr().out
    finally:
        pm.unregister(plugin)
    assert plugin_rows(out)["cli_test_plugin"] == ("-", "-")  # not from a distribution
    phases = [(name, owner) for _, name, owner in phase_rows(out)]
    assert phases[0] == (FIRST_PHASE, "hyperfsdp.core")
    early = phases.index(("aa.cli_test_early", "cli_test_plugin"))
    late = phases.index(("zz.cli_test_late", "cli_test_plugin"))
    assert early < late
    main(["plugins"])
    assert "cli_test" not in capsys.readouterr().out  # gone once unregistered


def _run_module(*args: str, disable_autoload: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(DISABLE_AUTOLOAD_ENV, None)
    if disable_autoload:
        env[DISABLE_AUTOLOAD_ENV] = "1"
    return subprocess.run(
        [sys.executable, "-m", "hyperfsdp_core", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_python_m_hyperfsdp_core_plugins():
    proc = _run_module("plugins", disable_autoload=False)
    assert proc.returncode == 0, proc.stderr
    rows = plugin_rows(proc.stdout)
    for name in BUILTINS:
        assert rows[name] == ("hyperfsdp", VERSION)
    assert "not loaded" not in proc.stdout
    assert phase_rows(proc.stdout)[0] == (1, FIRST_PHASE, "hyperfsdp.core")


def test_plugins_says_when_autoload_is_disabled(capsys, monkeypatch):
    from hyperfsdp_core.plugin import manager as plugins

    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    monkeypatch.setattr(plugins, "_manager", None)  # rebuilt with the switch on, then restored
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert f"(entry-point plugins not loaded: {DISABLE_AUTOLOAD_ENV} is set)" in out
    assert list(plugin_rows(out)) == list(BUILTINS)
    assert [name for _, name, _ in phase_rows(out)] == [FIRST_PHASE]


def test_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hyperfsdp")
    assert re.search(r"^\s+plugins\s+list installed plugins", out, re.MULTILINE)
    assert re.search(r"^\s+demo\s+", out, re.MULTILINE)


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert capsys.readouterr().out.startswith("usage: hyperfsdp")


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    assert info.value.code == 2
    assert "invalid choice: 'no-such-command'" in capsys.readouterr().err


def test_console_script_help():
    script = os.path.join(os.path.dirname(sys.executable), "hyperfsdp")
    assert os.path.exists(script), "`make install` installs the hyperfsdp console script"
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: hyperfsdp")
    assert "plugins" in proc.stdout


def test_plugins_reports_a_plugin_that_fails_to_import(capsys, monkeypatch):
    from hyperfsdp_core.plugin import manager as plugins
    from hyperfsdp_core.plugin import versions

    def broken(**kwargs):
        raise versions.PluginLoadError(
            "hyperfsdp plugin 'fake' from distribution 'hyperfsdp-fake' 9.9 failed to import"
        )

    monkeypatch.setattr(plugins, "_manager", None)
    monkeypatch.setattr(plugins, "build_plugin_manager", broken)
    assert main(["plugins"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "hyperfsdp plugins: hyperfsdp plugin 'fake' from distribution 'hyperfsdp-fake' 9.9 "
        "failed to import\n"
    )


def test_bench_lists_its_cases(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for case in ("even w2 L8", "uneven w2 L8", "bf16 w2 L8", "no-reshard w2 L8", "hsdp w4 L8"):
        assert case in out
    assert "tp w4 L8                 impls: hyperfsdp, fsdp2, floor\n" in out
    assert "host-overhead w1 L64" in out and "host-overhead w2 L64" in out


@pytest.mark.parametrize("env", [PLUGINS_DISABLE_ENV, DISABLE_AUTOLOAD_ENV])
def test_bench_is_a_plugin_command(env, monkeypatch, capsys):
    """``hyperfsdp bench`` comes from the hyperfsdp-bench distribution (``benchmarks/``)
    through ``hyperfsdp_cli_commands``, as any plugin's command: installed (``make install``)
    it is there, listed as plugin ``bench``; not loaded, the core has no such command."""
    (ep,) = [e for e in importlib.metadata.entry_points(group="hyperfsdp") if e.name == "bench"]
    assert (ep.value, ep.dist.name) == ("hyperfsdp_bench.plugin", "hyperfsdp-bench")
    assert main(["plugins"]) == 0
    assert plugin_rows(capsys.readouterr().out)["bench"] == ("hyperfsdp-bench", VERSION)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"^\s+bench\s+benchmark hyperfsdp", capsys.readouterr().out, re.MULTILINE)

    from hyperfsdp_core.plugin import manager as _plugins

    monkeypatch.setenv(env, "bench" if env == PLUGINS_DISABLE_ENV else "1")
    monkeypatch.setattr(_plugins, "_manager", None)  # a fresh manager, restored afterwards
    with pytest.raises(SystemExit):
        main(["--help"])
    assert not re.search(r"^\s+bench\s", capsys.readouterr().out, re.MULTILINE)
    with pytest.raises(SystemExit) as info:
        main(["bench", "--list"])
    assert info.value.code == 2
    assert "invalid choice: 'bench'" in capsys.readouterr().err


def test_demo_help_describes_parity(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--world-size" in out and "reference" in out


class _HelloCommand:
    @hookimpl
    def hyperfsdp_cli_commands(self, subparsers):
        p = subparsers.add_parser("hook-hello", help="say hello (test plugin)")
        p.add_argument("name")
        p.set_defaults(func=lambda args: print(f"hello, {args.name}") or 3)


def test_hook_cli_commands(capsys):
    pm = get_plugin_manager()
    plugin = _HelloCommand()
    pm.register(plugin, name="cli_hello_plugin")
    try:
        assert main(["hook-hello", "world"]) == 3
        assert capsys.readouterr().out == "hello, world\n"
        with pytest.raises(SystemExit):
            main(["--help"])
        assert re.search(r"^\s+hook-hello\s+say hello", capsys.readouterr().out, re.MULTILINE)
    finally:
        pm.unregister(plugin)
    with pytest.raises(SystemExit) as info:
        main(["hook-hello", "world"])
    assert info.value.code == 2  # gone with its plugin
