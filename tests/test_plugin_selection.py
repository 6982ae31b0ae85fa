"""Choosing the plugins a process loads (``HYPERFSDP_PLUGINS_DISABLE``), reporting phase-order
cycles between installed plugins, and listing who answers the first-result hooks."""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from hyperfsdp_core import hookimpl
from hyperfsdp_core.cli import main
from hyperfsdp_core.plugin import manager as plugins
from hyperfsdp_core.plugin import versions
from hyperfsdp_core.plugin.manager import (
    BUILTIN_PLUGINS,
    DISABLE_AUTOLOAD_ENV,
    PLUGINS_DISABLE_ENV,
    PluginInfo,
    PluginSelectionError,
    PluginSelectionWarning,
    build_plugin_manager,
    get_plugin_manager,
)
from hyperfsdp_core.plugin.phases import Phase, PhaseOrderError

STEPS = 3
LR = 0.1

# -- fake distributions ---------------------------------------------------------------------------


def make_distribution(site, dist: str, entry_points: dict[str, str], modules: dict[str, str]):
    """Install a minimal distribution (version 1.0) into the folder ``site``."""
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[hyperfsdp]\n{lines}")
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    importlib.invalidate_caches()


#: A "gradient guard" a user might have installed in the environment: after every backward
#: it all-reduces the squared gradient norm (one extra collective per step) and halves every
#: gradient. Active, it changes both the collective counts and the training.
GUARD_PLUGIN = """
    import torch

    from hyperfsdp_core.plugin import FIRST_PHASE, Phase, hookimpl

    HYPERFSDP_API = ">=1.0,<2"


    def _guard(root):
        grads = [
            p.sharded_param.grad.to_local()
            for unit in root.units
            for p in unit.params
            if p.sharded_param.grad is not None
        ]
        total = torch.zeros(1)
        for g in grads:
            total += g.float().pow(2).sum()
        root.comm.all_reduce(total, None, unit="").wait()
        if total.item() > 0:
            for g in grads:
                g.mul_(0.5)


    @hookimpl
    def hyperfsdp_finalize_phases():
        return [Phase("guard.halve", _guard, after=FIRST_PHASE)]
"""

OTHER_PLUGIN = """
    from hyperfsdp_core.plugin import hookimpl

    HYPERFSDP_API = ">=1.0,<2"

    @hookimpl
    def hyperfsdp_validate_unit(unit):
        return None
"""

BROKEN_PLUGIN = """
    import hyperfsdp_fake_missing_dependency_xyz  # not installed anywhere
"""

# Two plugins of two distributions whose phases each want to run after the other's.
CYCLE_A = """
    from hyperfsdp_core.plugin import FIRST_PHASE, Phase, hookimpl

    HYPERFSDP_API = ">=1.0,<2"

    @hookimpl
    def hyperfsdp_finalize_phases():
        return [Phase("clip.norm", lambda root: None, after=FIRST_PHASE,
                      after_if_present="stats.log")]
"""

CYCLE_B = """
    from hyperfsdp_core.plugin import FIRST_PHASE, Phase, hookimpl

    HYPERFSDP_API = ">=1.0,<2"

    @hookimpl
    def hyperfsdp_finalize_phases():
        return [Phase("stats.log", lambda root: None, after_if_present="clip.norm")]
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for fake distributions; selection variables unset."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    monkeypatch.delenv(PLUGINS_DISABLE_ENV, raising=False)
    before = set(sys.modules)
    yield folder
    for name in set(sys.modules) - before:
        if name.startswith("hyperfsdp_fake"):
            del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture
def rank_site(tmp_path):
    """A folder for fake distributions that only the rank function puts on its sys.path (a
    folder on the driver's sys.path would stay on the ranks' path for later tests)."""
    folder = tmp_path / "rank_site"
    folder.mkdir()
    return folder


def _enter(site: str) -> None:
    sys.path.insert(0, site)
    importlib.invalidate_caches()


def _leave(site: str) -> None:
    while site in sys.path:
        sys.path.remove(site)
    for name in [n for n in sys.modules if n.startswith("hyperfsdp_fake")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    plugins.reset_plugin_manager()  # nothing of the fake distributions outlives the call


def install_guard(site) -> None:
    make_distribution(
        site,
        "hyperfsdp-fake-guard",
        {"fake_guard": "hyperfsdp_fake_guard", "fake_other": "hyperfsdp_fake_other"},
        {"hyperfsdp_fake_guard": GUARD_PLUGIN, "hyperfsdp_fake_other": OTHER_PLUGIN},
    )


def install_cycle(site) -> None:
    make_distribution(site, "hyperfsdp-fake-clip", {"fake_clip": "hyperfsdp_fake_clip"},
                      {"hyperfsdp_fake_clip": CYCLE_A})  # fmt: skip
    make_distribution(site, "hyperfsdp-fake-stats", {"fake_stats": "hyperfsdp_fake_stats"},
                      {"hyperfsdp_fake_stats": CYCLE_B})  # fmt: skip


# -- per-process selection ------------------------------------------------------------------------


def test_disabled_entry_point_is_neither_imported_nor_registered(site, monkeypatch):
    install_guard(site)
    monkeypatch.setenv(PLUGINS_DISABLE_ENV, "fake_guard")
    pm = build_plugin_manager()
    assert pm.get_plugin("fake_guard") is None
    assert "hyperfsdp_fake_guard" not in sys.modules
    assert pm.get_plugin("fake_other") is sys.modules["hyperfsdp_fake_other"]  # the rest loads
    assert "guard.halve" not in [p.name for p in pm.finalization_phases()]
    assert pm.disabled == {"fake_guard": PluginInfo("fake_guard", "hyperfsdp-fake-guard", "1.0")}
    assert pm.disabled_by == PLUGINS_DISABLE_ENV
    # Unset, the same environment loads it.
    monkeypatch.delenv(PLUGINS_DISABLE_ENV)
    pm = build_plugin_manager()
    assert pm.get_plugin("fake_guard") is sys.modules["hyperfsdp_fake_guard"]
    assert "guard.halve" in [p.name for p in pm.finalization_phases()]
    assert pm.disabled == {}


def test_disabling_a_broken_plugin_gets_the_process_going(site, monkeypatch):
    install_guard(site)
    make_distribution(
        site, "hyperfsdp-fake-broken", {"fake_broken": "hyperfsdp_fake_broken"},
        {"hyperfsdp_fake_broken": BROKEN_PLUGIN},
    )  # fmt: skip
    with pytest.raises(versions.PluginLoadError) as info:
        build_plugin_manager()
    assert f"{PLUGINS_DISABLE_ENV}=fake_broken" in str(info.value)  # the error says how
    monkeypatch.setenv(PLUGINS_DISABLE_ENV, "fake_broken")
    pm = build_plugin_manager()
    assert pm.get_plugin("fake_guard") is not None
    assert "hyperfsdp_fake_broken" not in sys.modules


@pytest.mark.parametrize(
    "value", ["fake_guard,fake_other", " fake_other  fake_guard ", "fake_guard, fake_other,"]
)
def test_names_are_separated_by_commas_or_spaces(site, monkeypatch, value):
    install_guard(site)
    monkeypatch.setenv(PLUGINS_DISABLE_ENV, value)
    pm = build_plugin_manager()
    assert pm.get_plugin("fake_guard") is None and pm.get_plugin("fake_other") is None
    assert sorted(pm.disabled) == ["fake_guard", "fake_other"]


def test_disable_argument_wins_over_the_environment(site, monkeypatch):
    install_guard(site)
    monkeypatch.setenv(PLUGINS_DISABLE_ENV, "fake_guard")
    pm = build_plugin_manager(disable=["fake_other"])
    assert pm.get_plugin("fake_guard") is not None and pm.get_plugin("fake_other") is None
    assert pm.disabled_by == "disable="
    assert build_plugin_manager(disable="").get_plugin("fake_guard") is not None
    assert build_plugin_manager(disable="fake_guard fake_other").disabled.keys() == {
        "fake_guard",
        "fake_other",
    }


@pytest.mark.parametrize("builtin", [name for name, _ in BUILTIN_PLUGINS])
def test_builtin_plugins_cannot_be_disabled(monkeypatch, builtin):
    monkeypatch.setenv(PLUGINS_DISABLE_ENV, f"dcp,{builtin}")
    with pytest.raises(PluginSelectionError) as info:
        build_plugin_manager()
    message = str(info.value)
    assert message.startswith(f"{PLUGINS_DISABLE_ENV} names {builtin!r}, a builtin plugin")
    assert "cannot be disabled" in message and f"Remove it from {PLUGINS_DISABLE_ENV}" in message
    with pytest.raises(PluginSelectionError, match=r"^disable= names"):
        build_plugin_manager(disable=[builtin])


def test_unknown_name_warns_listing_the_installed_plugins(site, monkeypatch):
    install_guard(site)
    monkeypatch.setenv(PLUGINS_DISABLE_ENV, "fake_gaurd")
    with pytest.warns(PluginSelectionWarning) as record:
        pm = build_plugin_manager()
    message = str(record[0].message)
    assert "'fake_gaurd'" in message and "no installed hyperfsdp plugin has that name" in message
    assert "fake_guard" in message.split("installed entry-point plugins:")[1]
    assert pm.get_plugin("fake_guard") is not None  # nothing else changes
    assert pm.disabled == {"fake_gaurd": None}


def test_disabled_name_is_refused_at_run_time_until_unblocked(site):
    with pytest.warns(PluginSelectionWarning, match="refused as well"):
        pm = build_plugin_manager(autoload=False, disable=["fake_guard"])  # not installed

    class Guard:
        @hookimpl
        def hyperfsdp_finalize_phases(self):
            return [Phase("guard.runtime", lambda root: None)]

    guard = Guard()
    assert pm.register(guard, name="fake_guard") is None  # pluggy's answer for a blocked name
    assert pm.get_plugin("fake_guard") is None
    assert "guard.runtime" not in [p.name for p in pm.finalization_phases()]
    pm.unblock("fake_guard")
    assert pm.register(guard, name="fake_guard") == "fake_guard"
    assert "guard.runtime" in [p.name for p in pm.finalization_phases()]


def test_no_selection_changes_nothing(monkeypatch):
    monkeypatch.delenv(PLUGINS_DISABLE_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginSelectionWarning)
        pm = build_plugin_manager()
    assert pm.disabled == {}
    assert not any(plugin is None for _, plugin in pm.list_name_plugin())  # nothing blocked


# -- multi-rank: the disabled guard changes neither collectives nor training -----------------------


def _batch(step: int, world: int):
    from hyperfsdp_core.testing.reference import mlp_batch

    return mlp_batch(step, 4 * world, 8)


def _build():
    import torch

    from hyperfsdp_core.testing.reference import MLPStack

    torch.manual_seed(0)
    return MLPStack([8, 16, 12, 4])


def _train(model, slice_batch: bool):
    import torch
    import torch.distributed as dist

    from hyperfsdp_core.testing.reference import local_slice, mse_loss

    world = dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # plain SGD: halved gradients show
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, world)
        if slice_batch:
            x, y = local_slice(x), local_slice(y)
        loss = mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if slice_batch:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


def _shard(model, fully_shard):
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _max_diff(model, other) -> float:
    from hyperfsdp_core.testing.reference import full

    theirs = dict(other.named_parameters())
    return max(
        (full(p.detach()) - full(theirs[name].detach())).abs().max().item()
        for name, p in model.named_parameters()
    )


def rank_train_with_guard_installed(site: str) -> dict:
    """Train hyperfsdp, torch's FSDP2 and an unsharded reference on the same global batch,
    in a process where the fake guard distribution is installed."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from hyperfsdp_core import fully_shard
    from hyperfsdp_core.testing.counting import CollectiveCounter

    _enter(site)
    try:
        pm = get_plugin_manager()  # built from this call's environment (the driver's)
        out = {
            "guard": pm.get_plugin("fake_guard") is not None,
            "imported": "hyperfsdp_fake_guard" in sys.modules,
            "other": pm.get_plugin("fake_other") is not None,
        }
        ref = _build()
        model = _shard(copy.deepcopy(ref), fully_shard)
        fsdp2 = _shard(copy.deepcopy(ref), fsdp2_fully_shard)
        out["ref"] = _train(ref, slice_batch=False)
        with CollectiveCounter() as counter:
            out["hyperfsdp"] = _train(model, slice_batch=True)
        out["all_reduces"] = counter.count("ar")  # the loop's own go straight to torch
        out["fsdp2"] = _train(fsdp2, slice_batch=True)
        out["diff_ref"] = _max_diff(model, ref)
        out["diff_fsdp2"] = _max_diff(model, fsdp2)
        return out
    finally:
        _leave(site)


@pytest.mark.parametrize("world", [2, 4])
def test_disabled_guard_leaves_collectives_and_training_as_fsdp2(
    run_ranks, rank_site, monkeypatch, world
):
    site = rank_site
    install_guard(site)
    # The harness hands the driver's selection to the ranks with every call.
    monkeypatch.setenv(PLUGINS_DISABLE_ENV, "fake_guard")
    for out in run_ranks(world, rank_train_with_guard_installed, str(site), timeout=240):
        assert (out["guard"], out["imported"], out["other"]) == (False, False, True)
        assert out["all_reduces"] == 0
        assert out["hyperfsdp"] == pytest.approx(out["ref"], rel=1e-5, abs=1e-6)
        assert out["hyperfsdp"] == pytest.approx(out["fsdp2"], rel=1e-5, abs=1e-6)
        assert out["diff_ref"] < 1e-5 and out["diff_fsdp2"] < 1e-5
    # The same ranks, the variable unset for the next call: the guard is back, and shows.
    monkeypatch.delenv(PLUGINS_DISABLE_ENV)
    for out in run_ranks(world, rank_train_with_guard_installed, str(site), timeout=240):
        assert (out["guard"], out["imported"]) == (True, True)
        assert out["all_reduces"] == STEPS  # one extra collective per backward
        assert out["hyperfsdp"][0] == pytest.approx(out["ref"][0], rel=1e-5)
        assert out["hyperfsdp"][-1] != pytest.approx(out["ref"][-1], rel=1e-4)
        assert out["diff_ref"] > 1e-3


def rank_two_d_mesh() -> str:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from hyperfsdp_core import fully_shard

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("r", "s"))
    try:
        fully_shard(nn.Linear(4, 4), mesh=mesh)
    except ImportError as exc:
        return str(exc)
    return "sharded: " + ",".join(p.name for p in get_plugin_manager().finalization_phases())


def test_disabling_an_installed_plugin_disables_its_feature(run_ranks, monkeypatch):
    monkeypatch.delenv(PLUGINS_DISABLE_ENV, raising=False)
    for out in run_ranks(4, rank_two_d_mesh):
        assert out.startswith("sharded: ") and "dp.all_reduce" in out
    monkeypatch.setenv(PLUGINS_DISABLE_ENV, "hsdp")
    for out in run_ranks(4, rank_two_d_mesh):
        assert "pip install hyperfsdp[hsdp]" in out


# -- phase-order cycles between installed plugins ---------------------------------------------------


def test_cycle_between_installed_plugins_names_them_and_how_to_disable_one(site, monkeypatch):
    install_cycle(site)
    with pytest.raises(PhaseOrderError) as info:
        build_plugin_manager()
    message = str(info.value)
    assert message.startswith("finalization phases form a cycle: ")
    assert "'clip.norm' (fake_clip)" in message and "'stats.log' (fake_stats)" in message
    assert "'stats.log' declares after_if_present='clip.norm'" in message
    assert "'clip.norm' declares after_if_present='stats.log'" in message
    assert "'fake_clip' (distribution 'hyperfsdp-fake-clip' 1.0)" in message
    assert f"set {PLUGINS_DISABLE_ENV}=fake_clip or {PLUGINS_DISABLE_ENV}=fake_stats" in message
    assert info.value.plugins == ("fake_clip", "fake_stats") or info.value.plugins == (
        "fake_stats",
        "fake_clip",
    )
    # Following the advice works.
    monkeypatch.setenv(PLUGINS_DISABLE_ENV, "fake_stats")
    assert "clip.norm" in [p.name for p in build_plugin_manager().finalization_phases()]


def rank_fully_shard_with_cycle(site: str) -> str:
    from torch import nn

    from hyperfsdp_core import fully_shard

    _enter(site)
    try:
        fully_shard(nn.Linear(4, 4))
    except PhaseOrderError as exc:
        return str(exc)
    finally:
        _leave(site)
    return "no error"


def test_fully_shard_raises_naming_the_cycle_and_its_plugins(run_ranks, rank_site):
    install_cycle(rank_site)
    for message in run_ranks(2, rank_fully_shard_with_cycle, str(rank_site)):
        assert message.startswith("finalization phases form a cycle")
        assert "fake_clip" in message and "fake_stats" in message
        assert PLUGINS_DISABLE_ENV in message


def test_plugins_command_reports_a_cycle_and_exits_non_zero(site, monkeypatch, capsys):
    install_cycle(site)
    monkeypatch.setattr(plugins, "_manager", None)  # rebuilt here, restored afterwards
    assert main(["plugins"]) == 1
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    # what is installed is still listed, with the phases' owners
    assert "fake_clip" in out and "hyperfsdp-fake-clip" in out and "fake_stats" in out
    assert "finalization order: cannot be resolved (see the error below)" in out
    assert "first-result hooks" in out
    assert err.startswith(
        "hyperfsdp plugins: error: the plugins' finalization phases cannot be ordered; every "
        "fully_shard call in this environment raises this until it is fixed:\n"
        "  finalization phases form a cycle: "
    )
    report = " ".join(err.split())
    assert "'clip.norm' (fake_clip)" in report and "'stats.log' (fake_stats)" in report
    assert f"set {PLUGINS_DISABLE_ENV}=fake_clip or {PLUGINS_DISABLE_ENV}=fake_stats" in report
    assert "Traceback" not in err


def test_plugins_command_in_a_fresh_process_reports_a_cycle_without_a_traceback(site):
    install_cycle(site)
    env = {
        k: v for k, v in os.environ.items() if k not in (PLUGINS_DISABLE_ENV, DISABLE_AUTOLOAD_ENV)
    }
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "hyperfsdp_core", "plugins"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "finalization phases form a cycle" in proc.stderr
    assert "fake_clip" in proc.stdout
    env[PLUGINS_DISABLE_ENV] = "fake_stats"
    proc = subprocess.run(
        [sys.executable, "-m", "hyperfsdp_core", "plugins"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "disabled plugins (not loaded: HYPERFSDP_PLUGINS_DISABLE):" in proc.stdout
    assert "fake_stats  hyperfsdp-fake-stats 1.0" in proc.stdout


def test_plugins_command_lists_the_disabled_plugins(site, monkeypatch, capsys):
    install_guard(site)
    monkeypatch.setenv(PLUGINS_DISABLE_ENV, "fake_guard,fake_typo")
    monkeypatch.setattr(plugins, "_manager", None)
    assert main(["plugins"]) == 0
    captured = capsys.readouterr()
    section = captured.out.split("disabled plugins (not loaded: HYPERFSDP_PLUGINS_DISABLE):\n")[1]
    assert section.splitlines()[:2] == [
        "  fake_guard  hyperfsdp-fake-guard 1.0",
        "  fake_typo   (no installed plugin has this name)",
    ]
    installed = captured.out.split("disabled plugins")[0]
    assert "fake_other" in installed and "fake_guard" not in installed
    assert captured.err == (
        f"hyperfsdp: warning: {PLUGINS_DISABLE_ENV} names 'fake_typo', but no installed "
        "hyperfsdp plugin has that name (installed entry-point plugins: "
        + ", ".join(sorted(n for n in _entry_point_names()))
        + "); check the spelling. A plugin registered at run time under that name is refused "
        "as well\n"
    )


def _entry_point_names() -> set[str]:
    return {ep.name for ep in importlib.metadata.entry_points(group="hyperfsdp")}


def test_plugins_command_reports_a_builtin_in_the_list(monkeypatch, capsys):
    monkeypatch.setenv(PLUGINS_DISABLE_ENV, "hyperfsdp.mixed_precision")
    monkeypatch.setattr(plugins, "_manager", None)
    assert main(["plugins"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(
        f"hyperfsdp plugins: {PLUGINS_DISABLE_ENV} names 'hyperfsdp.mixed_precision', a builtin"
    )


# -- first-result hooks: who answers, in which order ----------------------------------------------


class MeshA:
    @hookimpl
    def hyperfsdp_select_mesh_info(self, unit, fqn, param):
        return None


class MeshB:
    @hookimpl(tryfirst=True)
    def hyperfsdp_select_mesh_info(self, unit, fqn, param):
        return None


class LayoutWrapper:
    @hookimpl(wrapper=True)
    def hyperfsdp_param_layout(self, unit, fqn, param, mesh_info, shard_dim):
        return (yield)


def test_first_result_hooks_in_call_order_and_conflicts():
    pm = build_plugin_manager(autoload=False)
    hooks = pm.first_result_hooks()
    assert set(hooks) == {
        "hyperfsdp_select_mesh_info",
        "hyperfsdp_param_layout",
        "hyperfsdp_param_dtypes",
        "hyperfsdp_sharded_storage",
        "hyperfsdp_all_gather_input",
        "hyperfsdp_grad_landing",
        "hyperfsdp_load_convert",
        "hyperfsdp_transport",
    }
    assert hooks["hyperfsdp_transport"] == []  # no transport plugin: the core's default
    assert hooks["hyperfsdp_select_mesh_info"] == [("hyperfsdp.core", "trylast")]
    assert hooks["hyperfsdp_param_dtypes"] == [("hyperfsdp.mixed_precision", "")]
    assert hooks["hyperfsdp_sharded_storage"] == []
    assert pm.first_result_conflicts() == {}  # the core's trylast defaults are no conflict
    pm.register(MeshB(), name="mesh_b")
    pm.register(MeshA(), name="mesh_a")
    pm.register(LayoutWrapper(), name="layout_wrapper")
    assert pm.first_result_hooks()["hyperfsdp_select_mesh_info"] == [
        ("mesh_b", "tryfirst"),
        ("mesh_a", ""),
        ("hyperfsdp.core", "trylast"),
    ]
    assert pm.first_result_hooks()["hyperfsdp_param_layout"] == [
        ("layout_wrapper", "wrapper"),
        ("hyperfsdp.core", "trylast"),
    ]
    assert pm.first_result_conflicts() == {"hyperfsdp_select_mesh_info": ["mesh_b", "mesh_a"]}


def test_plugins_command_lists_first_result_hooks_and_flags_conflicts(capsys):
    pm = get_plugin_manager()
    added = [(MeshA(), "cli_mesh_a"), (MeshB(), "cli_mesh_b"), (LayoutWrapper(), "cli_wrap")]
    for plugin, name in added:
        pm.register(plugin, name=name)
    try:
        assert main(["plugins"]) == 0
        out = capsys.readouterr().out
        conflicts = pm.first_result_conflicts()["hyperfsdp_select_mesh_info"]
    finally:
        for plugin, _ in added:
            pm.unregister(plugin)
    section = out.split("first-result hooks (asked in this order; ")[1]
    rows = {line.split()[0]: line.split(None, 1)[1] for line in section.splitlines()[1:]
            if line.startswith("  hyperfsdp_")}  # fmt: skip
    assert rows["hyperfsdp_select_mesh_info"].startswith("cli_mesh_b [tryfirst], cli_mesh_a, ")
    assert rows["hyperfsdp_select_mesh_info"].endswith("hyperfsdp.core [trylast]")
    assert rows["hyperfsdp_param_layout"].startswith("cli_wrap [wrapper], ")
    assert rows["hyperfsdp_param_dtypes"] == "hyperfsdp.mixed_precision"
    assert conflicts[:2] == ["cli_mesh_b", "cli_mesh_a"]
    note = f"  note: {len(conflicts)} plugins answer hyperfsdp_select_mesh_info: "
    assert note + ", then ".join(conflicts) + "\n" in out
    assert main(["plugins"]) == 0
    assert "cli_" not in capsys.readouterr().out  # gone with the plugins
