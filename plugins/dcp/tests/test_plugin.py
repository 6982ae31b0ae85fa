"""The plugin as the core sees it: discovery, API range, CLI hook. (That it uses only
public core names is checked for every plugin by the core's ``tests/test_public_api.py``.)"""

import re

import hyperfsdp_dcp
from hyperfsdp_dcp import plugin

from hyperfsdp_core import get_plugin_manager


def test_discovered_through_its_entry_point():
    pm = get_plugin_manager()
    assert pm.get_plugin("dcp") is plugin
    impls = [i.plugin for i in pm.hook.hyperfsdp_cli_commands.get_hookimpls()]
    assert plugin in impls


def test_declares_the_plugin_api_range():
    assert plugin.HYPERFSDP_API == ">=1.1,<2"  # group_timeout
    assert all(
        re.fullmatch(r"(>=|<|<=|>|==)\d+(\.\d+)*", s) for s in plugin.HYPERFSDP_API.split(",")
    )


def test_public_names_are_documented():
    for name in hyperfsdp_dcp.__all__:
        obj = getattr(hyperfsdp_dcp, name)
        assert obj.__doc__ and obj.__doc__.strip(), name
