"""Every hook, in order, with every plugin of this repository installed (tox's call-log test).

A throwaway plugin implements every hookspec and logs each call; the root's transition
log records each finalization phase as it runs. One HSDP training step, evaluation,
``state_dict()``/``load_state_dict()`` and ``sharding_plan()`` then give an exact,
ordered log: a change in when the core calls a hook, or in the finalization order
that the installed plugins declare, shows up here.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from hyperfsdp_core import fully_shard
from hyperfsdp_core.plugin import FIRST_PHASE, Phase, hookimpl, hookspecs
from hyperfsdp_core.testing import registered, run_on_ranks

HOOKS = sorted(n for n, f in vars(hookspecs).items() if hasattr(f, "hyperfsdp_spec"))
#: the finalization order of this repository's plugins (core, hsdp, tp, offload, commlog example)
INSTALLED_ORDER = [
    "core.reduce_scatter_drain",
    "dp.all_reduce",
    "tp.replicate_all_reduce",
    "offload.grads_to_host",
    "commlog.summary",
]


class CallLog:
    """Implements every hook; answers nothing, so the installed plugins decide."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def _note(self, hook: str, what: str = "") -> None:
        entry = f"{hook}({what})" if what else hook
        if not self.log or self.log[-1] != entry:  # collapse runs (one per parameter)
            self.log.append(entry)

    @hookimpl
    def hyperfsdp_validate_unit(self, unit):
        self._note("validate_unit", ",".join(f for f, _ in unit.named_params[:1]))

    @hookimpl
    def hyperfsdp_sharded_storage(self, unit):
        self._note("sharded_storage")

    @hookimpl
    def hyperfsdp_select_mesh_info(self, unit, fqn, param):
        self._note("select_mesh_info")

    @hookimpl
    def hyperfsdp_param_layout(self, unit, fqn, param, mesh_info, shard_dim):
        self._note("param_layout")

    @hookimpl
    def hyperfsdp_param_dtypes(self, unit, param):
        self._note("param_dtypes")

    @hookimpl
    def hyperfsdp_module_mixins(self, unit):
        self._note("module_mixins")

    @hookimpl
    def hyperfsdp_forward_input_transform(self, unit):
        self._note("forward_input_transform", unit.fqn)

    @hookimpl
    def hyperfsdp_forward_output_transform(self, unit):
        self._note("forward_output_transform", unit.fqn)

    @hookimpl
    def hyperfsdp_all_gather_input(self, unit):
        self._note("all_gather_input", unit.fqn)

    @hookimpl
    def hyperfsdp_transport(self, unit):
        self._note("transport", unit.fqn)

    @hookimpl
    def hyperfsdp_gradient_reducers(self, unit):
        self._note("gradient_reducers", unit.fqn)

    @hookimpl
    def hyperfsdp_grad_landing(self, unit):
        self._note("grad_landing", unit.fqn)

    @hookimpl
    def hyperfsdp_finalize_phases(self):
        last = (*INSTALLED_ORDER[1:], "tp.replicate_all_reduce", "offload.grads_to_host")
        return [Phase("zz.call_log", self._phase, after=FIRST_PHASE, after_if_present=last)]

    def _phase(self, root) -> None:
        self._note("finalize_phases", "zz.call_log ran")

    @hookimpl
    def hyperfsdp_collective_observer(self, root):
        self._note("collective_observer")

    @hookimpl
    def hyperfsdp_state_dict_pre_save(self, unit):
        self._note("state_dict_pre_save", unit.fqn)

    @hookimpl
    def hyperfsdp_load_convert(self, param, value):
        self._note("load_convert")

    @hookimpl
    def hyperfsdp_state_dict_post_load(self, unit):
        self._note("state_dict_post_load", unit.fqn)

    @hookimpl
    def hyperfsdp_param_reset(self, param):
        self._note("param_reset")

    @hookimpl
    def hyperfsdp_plan_columns(self, param):
        self._note("plan_columns")

    @hookimpl
    def hyperfsdp_cli_commands(self, subparsers):
        self._note("cli_commands")


def rank_call_order():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    plugin = CallLog()
    with registered(plugin, "call_log") as pm:
        declared = [p.name for p in pm.finalization_phases()]
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        plugin.log.append("-- step")
        model(torch.randn(4, 8))  # lazy init
        log = model._hyperfsdp_state.ctx.enable_transition_log()
        model(torch.randn(4, 8)).sum().backward()
        phases = [old for _, event, old, _ in log if event == "phase"]
        plugin.log.append("-- eval")
        with torch.no_grad():
            model(torch.randn(4, 8))
        plugin.log.append("-- save")
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        plugin.log.append("-- load")
        model.load_state_dict(full)
        plugin.log.append("-- plan")
        model.sharding_plan()
        from hyperfsdp_core.cli import build_parser

        plugin.log.append("-- cli")
        build_parser()
    return plugin.log, phases, declared


def test_every_hook_in_order_with_every_plugin_installed():
    for log, phases, declared in run_on_ranks(4, rank_call_order, timeout=120):
        assert phases == [*INSTALLED_ORDER, "zz.call_log"] == declared
        # fully_shard(model[0]), then fully_shard(model): the unit's checks and storage,
        # then per parameter its mesh info, layout and dtypes, then the class mixins
        init = ["sharded_storage", *["select_mesh_info", "param_layout", "param_dtypes"] * 2]
        init.append("module_mixins")
        # per unit that manages parameters: the callables derived from its storage
        storage = ["all_gather_input{}", "transport{}", "gradient_reducers{}", "grad_landing{}"]
        root, layer = [e.format("") for e in storage], [e.format("(0)") for e in storage]
        assert log == [
            "validate_unit(weight)",
            *init,
            "validate_unit(2.weight)",
            *init,
            "-- step",
            # lazy init, root first: storage callables, then forward callables; observers
            *root,
            "forward_input_transform",
            "forward_output_transform",
            *layer,
            "forward_input_transform(0)",
            "forward_output_transform(0)",
            "collective_observer",
            # the backward: the phases run (the installed ones log nothing here)
            "finalize_phases(zz.call_log ran)",
            "-- eval",  # no hook runs per step
            "-- save",
            "state_dict_pre_save",  # outermost unit first
            "state_dict_pre_save(0)",
            "-- load",
            "load_convert",  # plain full tensors: converted per parameter before loading
            # copied into the existing storage: nothing rebuilt, no callables resolved again
            "param_reset",
            "state_dict_post_load(0)",  # innermost unit first
            "param_reset",
            "state_dict_post_load",
            "-- plan",
            "plan_columns",
            "-- cli",
            "cli_commands",
        ]
        called = {"hyperfsdp_" + e.split("(")[0] for e in log if not e.startswith("--")}
        assert called == set(HOOKS)
