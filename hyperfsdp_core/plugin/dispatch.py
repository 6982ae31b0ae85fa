"""The plugin layer's answer to the engine's :class:`~hyperfsdp_core.engine.port.PluginPort`:
views built here, hooks resolved here into plain callables.

One :data:`DISPATCH` serves every unit; it asks the process-wide plugin manager each time
(tests and users register plugins between models), so nothing here is per model.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..engine.port import ForwardHooks, GradientHooks, RootHooks
from .manager import get_plugin_manager
from .views import ParamView, RootView, UnitView


class PluginDispatch:
    """Builds the views of engine objects and resolves the hooks the engine runs."""

    def param_view(self, param: Any) -> ParamView:
        return ParamView(param)

    def unit_view(self, state: Any) -> UnitView:
        return UnitView(state)

    def root_view(self, ctx: Any) -> RootView:
        return RootView(ctx)

    def all_gather_input(
        self, unit: UnitView
    ) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        return get_plugin_manager().hook.hyperfsdp_all_gather_input(unit=unit)

    def gradient_hooks(self, unit: UnitView) -> GradientHooks:
        hook = get_plugin_manager().hook
        return GradientHooks(
            reducers=tuple(r for r in hook.hyperfsdp_gradient_reducers(unit=unit) if r),
            land_grad=hook.hyperfsdp_grad_landing(unit=unit),
        )

    def forward_hooks(self, unit: UnitView) -> ForwardHooks:
        hook = get_plugin_manager().hook
        return ForwardHooks(
            inputs=tuple(f for f in hook.hyperfsdp_forward_input_transform(unit=unit) if f),
            outputs=tuple(f for f in hook.hyperfsdp_forward_output_transform(unit=unit) if f),
        )

    def root_hooks(self, root: RootView) -> RootHooks:
        pm = get_plugin_manager()
        return RootHooks(
            finalize_runs=tuple((phase.name, phase.run) for phase in pm.finalization_phases()),
            observers=tuple(f for f in pm.hook.hyperfsdp_collective_observer(root=root) if f),
        )

    def transport_question(self, unit: UnitView) -> Callable[[], Any]:
        return partial(get_plugin_manager().hook.hyperfsdp_transport, unit=unit)

    def param_dtypes(
        self, spec: Any, param: torch.Tensor
    ) -> tuple[torch.dtype | None, torch.dtype | None]:
        hook = get_plugin_manager().hook.hyperfsdp_param_dtypes
        return hook(unit=spec, param=param) or (None, None)

    def param_reset(self, param: ParamView) -> None:
        get_plugin_manager().hook.hyperfsdp_param_reset(param=param)


#: The dispatch every unit is given by ``fully_shard``.
DISPATCH = PluginDispatch()
