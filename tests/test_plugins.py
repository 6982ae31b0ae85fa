"""The plugin manager: finalization-phase ordering, registration, entry-point loading."""

from __future__ import annotations

import importlib
import sys
import textwrap
import threading
import types

import pluggy
import pytest

from hyperfsdp_core import hookimpl
from hyperfsdp_core.plugin import manager as plugins
from hyperfsdp_core.plugin import versions
from hyperfsdp_core.plugin.manager import (
    BUILTIN_PLUGINS,
    DISABLE_AUTOLOAD_ENV,
    HyperFSDPPluginManager,
    PluginInfo,
    build_plugin_manager,
    get_plugin_manager,
)
from hyperfsdp_core.plugin.phases import FIRST_PHASE, Phase, PhaseOrderError, order_phases
from hyperfsdp_core.plugin.versions import PluginLoadError


def _noop(ctx) -> None:
    return None


class PhasePlugin:
    """A throwaway plugin that declares the given phases."""

    def __init__(self, *phases: Phase) -> None:
        self.phases = list(phases)

    @hookimpl
    def hyperfsdp_finalize_phases(self):
        return self.phases


@pytest.fixture
def pm() -> HyperFSDPPluginManager:
    """A fresh manager with only the builtin plugins (no entry points)."""
    return build_plugin_manager(autoload=False)


def names(pm: HyperFSDPPluginManager) -> list[str]:
    return [phase.name for phase in pm.finalization_phases()]


# -- ordering -------------------------------------------------------------------------------------


def test_builtin_manager_has_builtins_and_only_the_core_phase(pm):
    assert [name for name, _ in pm.list_name_plugin()] == [n for n, _ in BUILTIN_PLUGINS]
    assert names(pm) == [FIRST_PHASE]


def test_after_and_before_order_phases_across_plugins(pm):
    # Registered in an order that is neither alphabetical nor the dependency order;
    # each registration is validated at once, so a plugin may only name installed phases.
    offload = Phase("o.offload", _noop, after_if_present="t.tp_all_reduce")
    pm.register(PhasePlugin(offload), name="offload")
    pm.register(
        PhasePlugin(Phase("t.tp_all_reduce", _noop, after_if_present="d.dp_all_reduce")), "tp"
    )
    assert names(pm) == [FIRST_PHASE, "t.tp_all_reduce", "o.offload"]
    dp = Phase("d.dp_all_reduce", _noop, before=["o.offload", "t.tp_all_reduce"])
    pm.register(PhasePlugin(dp), name="dp")
    assert names(pm) == [FIRST_PHASE, "d.dp_all_reduce", "t.tp_all_reduce", "o.offload"]
    # "a.audit" sorts first by name but must follow "o.offload".
    pm.register(PhasePlugin(Phase("a.audit", _noop, after="o.offload")), name="audit")
    order = pm.finalization_phases()
    assert [p.name for p in order] == [
        FIRST_PHASE,
        "d.dp_all_reduce",
        "t.tp_all_reduce",
        "o.offload",
        "a.audit",
    ]
    assert order[1] is dp and order[3] is offload  # the declared objects themselves


def test_before_constraint_pulls_a_phase_ahead_of_a_smaller_name(pm):
    pm.register(PhasePlugin(Phase("a.first_by_name", _noop)), name="a")
    pm.register(PhasePlugin(Phase("z.last_by_name", _noop, before="a.first_by_name")), name="z")
    assert names(pm) == [FIRST_PHASE, "z.last_by_name", "a.first_by_name"]


def test_if_present_constraints_apply_only_when_the_phase_exists(pm):
    # "z.late" wants to run before "a.early" only if it is installed; it is not yet.
    pm.register(
        PhasePlugin(
            Phase(
                "m.middle",
                _noop,
                after_if_present=("z.late", "not.installed"),
                before_if_present="not.installed.either",
            )
        ),
        name="middle",
    )
    assert names(pm) == [FIRST_PHASE, "m.middle"]
    pm.register(PhasePlugin(Phase("z.late", _noop)), name="late")
    assert names(pm) == [FIRST_PHASE, "z.late", "m.middle"]
    pm.register(PhasePlugin(Phase("b.before_late", _noop, before_if_present="z.late")), "bl")
    assert names(pm) == [FIRST_PHASE, "b.before_late", "z.late", "m.middle"]
    pm.unregister(name="late")
    assert names(pm) == [FIRST_PHASE, "b.before_late", "m.middle"]


@pytest.mark.parametrize("registration", [("c", "a", "b"), ("b", "c", "a"), ("a", "b", "c")])
def test_ties_are_broken_by_name_whatever_the_registration_order(registration):
    pm = build_plugin_manager(autoload=False)
    for letter in registration:
        pm.register(PhasePlugin(Phase(f"{letter}.phase", _noop)), name=f"plugin_{letter}")
    assert names(pm) == [FIRST_PHASE, "a.phase", "b.phase", "c.phase"]


def test_ties_inside_one_plugin_are_broken_by_name(pm):
    pm.register(
        PhasePlugin(
            Phase("x.2", _noop),
            Phase("x.3", _noop, after="x.1"),
            Phase("x.1", _noop),
            Phase("x.0", _noop, after="x.3"),
        ),
        name="x",
    )
    assert names(pm) == [FIRST_PHASE, "x.1", "x.2", "x.3", "x.0"]


def test_core_drain_is_always_first(pm):
    # Names that sort before "core." and phases with no constraints at all.
    pm.register(PhasePlugin(Phase("a.unconstrained", _noop), Phase("0.digits", _noop)), "p")
    order = names(pm)
    assert order == [FIRST_PHASE, "0.digits", "a.unconstrained"]


def test_order_phases_without_the_core_phase_is_pure_topological_order():
    phases = {n: Phase(n, _noop) for n in ("c", "b", "a")}
    phases["a"] = Phase("a", _noop, after="c")
    order = order_phases(phases, {n: "p" for n in phases})
    assert [p.name for p in order] == ["b", "c", "a"]


def test_phase_names_are_normalized_to_tuples():
    phase = Phase("p.x", _noop, after="a", before=["b", "c"], after_if_present=iter(("d",)))
    assert phase.after == ("a",)
    assert phase.before == ("b", "c")
    assert phase.after_if_present == ("d",)
    assert phase.before_if_present == ()
    with pytest.raises(TypeError):
        Phase(3, _noop)  # type: ignore[arg-type]


# -- invalid phase declarations: rejected at registration, rolled back ------------------------------


def _assert_rolled_back(pm, plugin, before_names, before_generation) -> None:
    assert pm.get_plugin("bad") is None
    assert not pm.is_registered(plugin)
    assert all(
        impl.plugin is not plugin for impl in pm.hook.hyperfsdp_finalize_phases.get_hookimpls()
    )
    assert names(pm) == before_names
    assert pm.generation > before_generation  # caches built on the bad plugin are stale


def test_cycle_is_rejected_naming_phases_and_plugins(pm):
    pm.register(
        PhasePlugin(Phase("dp.reduce", _noop, after_if_present="tp.reduce")), name="hsdp_plugin"
    )
    before, generation = names(pm), pm.generation
    bad = PhasePlugin(Phase("tp.reduce", _noop, after="dp.reduce"))
    with pytest.raises(PhaseOrderError, match="cycle") as info:
        pm.register(bad, name="bad")
    message = str(info.value)
    for involved in ("'dp.reduce'", "'tp.reduce'", "hsdp_plugin", "bad"):
        assert involved in message
    _assert_rolled_back(pm, bad, before, generation)
    # The manager still works: a valid plugin registers afterwards.
    pm.register(PhasePlugin(Phase("tp.reduce", _noop)), name="ok")
    assert names(pm) == [FIRST_PHASE, "tp.reduce", "dp.reduce"]


def test_cycle_through_before_is_rejected(pm):
    generation = pm.generation
    bad = PhasePlugin(
        Phase("p.one", _noop, before="p.two"),
        Phase("p.two", _noop, before="p.three"),
        Phase("p.three", _noop, before="p.one"),
    )
    with pytest.raises(PhaseOrderError, match="cycle") as info:
        pm.register(bad, name="bad")
    assert all(f"'p.{n}'" in str(info.value) for n in ("one", "two", "three"))
    _assert_rolled_back(pm, bad, [FIRST_PHASE], generation)


@pytest.mark.parametrize("field", ["after", "before"])
def test_unknown_phase_name_is_rejected(pm, field):
    before, generation = names(pm), pm.generation
    bad = PhasePlugin(Phase("x.mine", _noop, **{field: "dp.all_reduce"}))
    with pytest.raises(PhaseOrderError) as info:
        pm.register(bad, name="bad")
    message = str(info.value)
    assert "'x.mine'" in message and "'bad'" in message
    assert "unknown phase 'dp.all_reduce'" in message
    assert "after_if_present" in message  # says what to do instead
    _assert_rolled_back(pm, bad, before, generation)


@pytest.mark.parametrize("field", ["before", "before_if_present"])
def test_running_before_the_core_drain_is_rejected(pm, field):
    before, generation = names(pm), pm.generation
    bad = PhasePlugin(Phase("x.too_early", _noop, **{field: FIRST_PHASE}))
    with pytest.raises(PhaseOrderError, match="always runs first") as info:
        pm.register(bad, name="bad")
    assert "'x.too_early'" in str(info.value) and "'bad'" in str(info.value)
    _assert_rolled_back(pm, bad, before, generation)


def test_phase_declared_twice_is_rejected_naming_both_plugins(pm):
    pm.register(PhasePlugin(Phase("dup.phase", _noop)), name="first_plugin")
    before, generation = names(pm), pm.generation
    bad = PhasePlugin(Phase("dup.phase", _noop))
    with pytest.raises(PhaseOrderError, match="declared twice") as info:
        pm.register(bad, name="bad")
    assert "'first_plugin'" in str(info.value) and "'bad'" in str(info.value)
    _assert_rolled_back(pm, bad, before, generation)


def test_phase_hook_returning_a_non_phase_is_rejected(pm):
    class NotAPhase:
        @hookimpl
        def hyperfsdp_finalize_phases(self):
            return [("my.phase", _noop)]

    bad, generation = NotAPhase(), pm.generation
    with pytest.raises(PhaseOrderError, match=r"expected hyperfsdp_core\.plugin\.Phase") as info:
        pm.register(bad, name="bad")
    assert "'bad'" in str(info.value)
    _assert_rolled_back(pm, bad, [FIRST_PHASE], generation)


def test_phase_hook_that_raises_is_rolled_back(pm):
    class Broken:
        @hookimpl
        def hyperfsdp_finalize_phases(self):
            raise RuntimeError("phase declaration exploded")

    bad, generation = Broken(), pm.generation
    with pytest.raises(RuntimeError, match="phase declaration exploded"):
        pm.register(bad, name="bad")
    _assert_rolled_back(pm, bad, [FIRST_PHASE], generation)


def test_initial_load_with_a_cycle_fails_at_seal():
    pm = HyperFSDPPluginManager()
    pm.register(PhasePlugin(Phase("a", _noop, after="b")), name="pa")
    pm.register(PhasePlugin(Phase("b", _noop, after="a")), name="pb")  # not sealed: no check yet
    with pytest.raises(PhaseOrderError, match="cycle") as info:
        pm.seal()
    assert "pa" in str(info.value) and "pb" in str(info.value)


# -- hook names and signatures --------------------------------------------------------------------


def test_unknown_hook_name_is_rejected_and_rolled_back(pm):
    class Typo:
        @hookimpl
        def hyperfsdp_finalise_phases(self):  # British spelling: not a hook
            return []

    bad = Typo()
    generation = pm.generation
    with pytest.raises(pluggy.PluginValidationError, match="hyperfsdp_finalise_phases"):
        pm.register(bad, name="bad")
    assert pm.get_plugin("bad") is None
    assert not hasattr(pm.hook, "hyperfsdp_finalise_phases") or not (
        pm.hook.hyperfsdp_finalise_phases.get_hookimpls()
    )
    assert pm.generation > generation
    pm.check_pending()  # nothing left behind


def test_unknown_hook_argument_is_rejected_before_registration(pm):
    class WrongArgs:
        @hookimpl
        def hyperfsdp_validate_unit(self, unit, not_an_argument):
            return None

    bad = WrongArgs()
    with pytest.raises(pluggy.PluginValidationError, match="not_an_argument"):
        pm.register(bad, name="bad")
    assert pm.get_plugin("bad") is None
    assert [impl.plugin_name for impl in pm.hook.hyperfsdp_validate_unit.get_hookimpls()] == [
        "hyperfsdp.core"
    ]


def test_registering_a_valid_plugin_bumps_the_generation(pm):
    class Valid:
        @hookimpl
        def hyperfsdp_validate_unit(self, unit):
            return None

    generation = pm.generation
    plugin = Valid()
    assert pm.register(plugin, name="valid") == "valid"
    assert pm.generation == generation + 1
    pm.unregister(plugin)
    assert pm.generation == generation + 2
    assert pm.get_plugin("valid") is None


# -- entry points ---------------------------------------------------------------------------------


def make_distribution(
    site, dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str]
) -> None:
    """Install a minimal distribution (``*.dist-info`` plus modules) into the folder ``site``."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[hyperfsdp]\n{lines}")
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    importlib.invalidate_caches()


GOOD_PLUGIN = """
    from hyperfsdp_core.plugin import Phase, hookimpl

    HYPERFSDP_API = ">=1.0,<2"

    def _run(ctx):
        pass

    @hookimpl
    def hyperfsdp_finalize_phases():
        return [Phase("fake.after_drain", _run, after="core.reduce_scatter_drain")]
"""

SECOND_PLUGIN = """
    from hyperfsdp_core import hookimpl

    HYPERFSDP_API = ">=1"

    @hookimpl
    def hyperfsdp_validate_unit(unit):
        return None
"""

BROKEN_PLUGIN = """
    import hyperfsdp_fake_missing_dependency_xyz  # not installed anywhere
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for fake distributions; their modules are forgotten afterwards."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    before = set(sys.modules)
    yield folder
    for name in set(sys.modules) - before:
        if name.startswith("hyperfsdp_fake"):
            del sys.modules[name]


def test_entry_point_plugins_are_discovered_and_registered(site):
    make_distribution(
        site,
        "hyperfsdp-fake-good",
        "1.2.3",
        {"zz_fake_second": "hyperfsdp_fake_second", "fake_good": "hyperfsdp_fake_good"},
        {"hyperfsdp_fake_good": GOOD_PLUGIN, "hyperfsdp_fake_second": SECOND_PLUGIN},
    )
    pm = build_plugin_manager()
    good = pm.get_plugin("fake_good")
    assert good is sys.modules["hyperfsdp_fake_good"]
    assert pm.get_plugin("zz_fake_second") is sys.modules["hyperfsdp_fake_second"]
    # Builtins first, then entry points sorted by entry-point name.
    registered = [name for name, _ in pm.list_name_plugin()]
    assert registered[: len(BUILTIN_PLUGINS)] == [name for name, _ in BUILTIN_PLUGINS]
    assert registered.index("fake_good") < registered.index("zz_fake_second")
    infos = {info.name: info for info in pm.plugin_infos()}
    assert infos["fake_good"] == PluginInfo("fake_good", "hyperfsdp-fake-good", "1.2.3")
    assert infos["zz_fake_second"] == PluginInfo("zz_fake_second", "hyperfsdp-fake-good", "1.2.3")
    assert infos["hyperfsdp.core"].distribution == "hyperfsdp"
    order = names(pm)
    assert order[0] == FIRST_PHASE
    assert "fake.after_drain" in order
    validators = [impl.plugin_name for impl in pm.hook.hyperfsdp_validate_unit.get_hookimpls()]
    assert "zz_fake_second" in validators


def test_broken_plugin_raises_plugin_load_error_naming_its_distribution(site):
    make_distribution(
        site,
        "hyperfsdp-fake-broken",
        "0.4.2",
        {"fake_broken": "hyperfsdp_fake_broken"},
        {"hyperfsdp_fake_broken": BROKEN_PLUGIN},
    )
    with pytest.raises(PluginLoadError) as info:
        build_plugin_manager()
    message = str(info.value)
    assert "'fake_broken'" in message
    assert "'hyperfsdp-fake-broken' 0.4.2" in message
    assert "ModuleNotFoundError" in message
    assert "hyperfsdp_fake_missing_dependency_xyz" in message
    assert DISABLE_AUTOLOAD_ENV in message  # says how to get going again
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_autoload_switch_skips_entry_points(site, monkeypatch):
    make_distribution(
        site,
        "hyperfsdp-fake-good",
        "1.2.3",
        {"fake_good": "hyperfsdp_fake_good"},
        {"hyperfsdp_fake_good": GOOD_PLUGIN},
    )
    make_distribution(
        site,
        "hyperfsdp-fake-broken",
        "0.4.2",
        {"fake_broken": "hyperfsdp_fake_broken"},
        {"hyperfsdp_fake_broken": BROKEN_PLUGIN},
    )
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    pm = build_plugin_manager()  # the broken plugin is not even imported
    assert [name for name, _ in pm.list_name_plugin()] == [n for n, _ in BUILTIN_PLUGINS]
    assert names(pm) == [FIRST_PHASE]
    assert "hyperfsdp_fake_broken" not in sys.modules
    # An explicit argument wins over the environment.
    with pytest.raises(PluginLoadError, match="hyperfsdp-fake-broken"):
        build_plugin_manager(autoload=True)
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV)
    assert build_plugin_manager(autoload=False).get_plugin("fake_good") is None


def test_entry_point_already_registered_by_name_is_not_loaded_twice(site, monkeypatch):
    make_distribution(
        site,
        "hyperfsdp-fake-good",
        "1.2.3",
        {"hyperfsdp.core": "hyperfsdp_fake_good"},
        {"hyperfsdp_fake_good": GOOD_PLUGIN},
    )
    pm = build_plugin_manager()
    assert pm.get_plugin("hyperfsdp.core").__name__ == "hyperfsdp_core.plugin.builtin.core"
    assert "hyperfsdp_fake_good" not in sys.modules


# -- the process-wide manager ---------------------------------------------------------------------


def test_get_plugin_manager_is_process_wide_and_built_once(monkeypatch):
    monkeypatch.setattr(plugins, "_manager", None)  # restored after the test
    built = []
    real = plugins.build_plugin_manager

    def counting_build(**kwargs):
        built.append(threading.get_ident())
        return real(autoload=False)

    monkeypatch.setattr(plugins, "build_plugin_manager", counting_build)
    results: list[HyperFSDPPluginManager] = []
    barrier = threading.Barrier(4)

    def worker() -> None:
        barrier.wait()
        results.append(get_plugin_manager())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    first = get_plugin_manager()
    assert len(built) == 1
    assert len(results) == 4 and all(r is first for r in results)
    assert isinstance(first, HyperFSDPPluginManager)
    import hyperfsdp_core

    assert hyperfsdp_core.get_plugin_manager() is first
    plugins.reset_plugin_manager()
    second = get_plugin_manager()
    assert second is not first
    assert len(built) == 2


def test_process_wide_manager_is_sealed_and_rejects_bad_plugins():
    pm = get_plugin_manager()
    bad = PhasePlugin(Phase("x.bad", _noop, after="no.such.phase"))
    before = names(pm)
    with pytest.raises(PhaseOrderError, match=r"no\.such\.phase"):
        pm.register(bad, name="test_plugins_bad")
    assert pm.get_plugin("test_plugins_bad") is None
    assert names(pm) == before
    good = PhasePlugin(Phase("x.good", _noop, after=FIRST_PHASE))
    pm.register(good, name="test_plugins_good")
    try:
        assert names(pm)[0] == FIRST_PHASE
        assert "x.good" in names(pm)
    finally:
        pm.unregister(good)
    assert names(pm) == before


def test_phase_owners_name_the_declaring_plugin(pm):
    pm.register(PhasePlugin(Phase("x.mine", _noop), Phase("x.also_mine", _noop)), name="mine")
    assert pm.phase_owners() == {
        FIRST_PHASE: "hyperfsdp.core",
        "x.mine": "mine",
        "x.also_mine": "mine",
    }
    pm.unregister(name="mine")
    assert pm.phase_owners() == {FIRST_PHASE: "hyperfsdp.core"}


def test_autoloaded_flag_records_whether_entry_points_were_loaded(monkeypatch):
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    assert build_plugin_manager().autoloaded is True
    assert build_plugin_manager(autoload=False).autoloaded is False
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    assert build_plugin_manager().autoloaded is False


def test_unregistering_an_entry_point_plugin_forgets_its_distribution(site):
    make_distribution(
        site,
        "hyperfsdp-fake-good",
        "1.2.3",
        {"fake_good": "hyperfsdp_fake_good"},
        {"hyperfsdp_fake_good": GOOD_PLUGIN},
    )
    pm = build_plugin_manager()
    pm.unregister(name="fake_good")
    assert "fake_good" not in {info.name for info in pm.plugin_infos()}
    replacement = PhasePlugin(Phase("fake.after_drain", _noop))
    pm.register(replacement, name="fake_good")
    infos = {info.name: info for info in pm.plugin_infos()}
    assert infos["fake_good"] == PluginInfo("fake_good", "-", "-")


# -- plugin API versions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "ok"),
    [
        (">=1.0,<2", True),
        (">=1", True),
        (">=1.2,<2", True),
        ("==1.2", True),
        ("==1", False),
        (">=1.3", False),
        ("<1.2", False),
        (">=0.9, <1.0", False),
        ("!=1.2", False),
        (">0.9,<=1.2", True),
    ],
)
def test_supports_api_against_version_1_2(spec, ok):
    assert versions.API_VERSION == (1, 2)
    assert versions.supports_api(spec) is ok


@pytest.mark.parametrize("spec", ["", "1.0", ">=one", "~=1.0", ">=1.0;<2"])
def test_malformed_api_range_is_rejected(pm, spec):
    plugin = types.SimpleNamespace(HYPERFSDP_API=spec)
    with pytest.raises(versions.PluginVersionError, match="'odd'"):
        pm.register(plugin, name="odd")
    assert pm.get_plugin("odd") is None


def test_runtime_plugin_with_an_unsupported_range_is_refused(pm):
    class Future:
        HYPERFSDP_API = ">=2.0,<3"

        @hookimpl
        def hyperfsdp_validate_unit(self, unit):
            return None

    with pytest.raises(versions.PluginVersionError) as info:
        pm.register(Future(), name="future")
    assert str(info.value) == (
        "hyperfsdp plugin 'future' supports plugin API >=2.0,<3, but hyperfsdp's plugin API "
        "is 1.2. Install a version of the plugin made for this hyperfsdp, or a hyperfsdp whose "
        "plugin API it supports"
    )
    assert pm.get_plugin("future") is None


OLD_PLUGIN = """
    from hyperfsdp_core.plugin import hookimpl

    HYPERFSDP_API = ">=0.1,<1"

    @hookimpl
    def hyperfsdp_validate_unit(unit):
        return None
"""

UNDECLARED_PLUGIN = """
    from hyperfsdp_core.plugin import hookimpl

    @hookimpl
    def hyperfsdp_validate_unit(unit):
        return None
"""


def test_entry_point_plugin_for_another_api_fails_at_load_naming_it(site):
    make_distribution(
        site,
        "hyperfsdp-fake-old",
        "0.0.9",
        {"fake_old": "hyperfsdp_fake_old"},
        {"hyperfsdp_fake_old": OLD_PLUGIN},
    )
    with pytest.raises(versions.PluginVersionError) as info:
        build_plugin_manager()
    assert str(info.value) == (
        "hyperfsdp plugin 'fake_old' from distribution 'hyperfsdp-fake-old' 0.0.9 supports "
        "plugin API >=0.1,<1, but hyperfsdp's plugin API is 1.2. Install a version of the "
        "plugin made for this hyperfsdp, or a hyperfsdp whose plugin API it supports"
    )
    assert isinstance(info.value, PluginLoadError)  # `hyperfsdp plugins` reports it


def test_entry_point_plugin_must_declare_its_api_range(site):
    make_distribution(
        site,
        "hyperfsdp-fake-undeclared",
        "1.0",
        {"fake_undeclared": "hyperfsdp_fake_undeclared"},
        {"hyperfsdp_fake_undeclared": UNDECLARED_PLUGIN},
    )
    with pytest.raises(
        versions.PluginVersionError, match="does not declare the plugin API"
    ) as info:
        build_plugin_manager()
    assert "HYPERFSDP_API = '>=1.0,<2'" in str(info.value)


def test_installed_plugins_declare_a_range_this_core_supports():
    pm = build_plugin_manager()
    for name, plugin in pm.list_name_plugin():
        if name in dict(BUILTIN_PLUGINS):
            continue
        spec = getattr(plugin, versions.API_ATTRIBUTE)
        assert versions.supports_api(spec), name
