"""The state-dict hooks fully_shard registers on each module of a unit.

``state_dict()`` saves the sharded parameters (the unit reshards first), ``load_state_dict()``
copies into them: plugins (and the core's default) convert incoming values beforehand, and
the unit resets its sharded storage afterwards. Each step also tells the plugins.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from .plugin.manager import get_plugin_manager


def register_state_dict_hooks(module: nn.Module) -> None:
    """Register the save, pre-load and post-load hooks on ``module`` (one of a unit's modules)."""
    module.register_state_dict_pre_hook(_before_state_dict)
    module.register_load_state_dict_pre_hook(_convert_before_load)
    module.register_load_state_dict_post_hook(_reset_after_load)


def _before_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    state = module._hyperfsdp_state  # type: ignore[attr-defined]
    if state.group is not None:
        state.group.reshard()
    get_plugin_manager().hook.hyperfsdp_state_dict_pre_save(unit=state.view)


def _convert_before_load(module: nn.Module, state_dict, prefix: str, *args) -> None:
    """Let plugins (and the core's default) convert incoming values of managed parameters."""
    state = module._hyperfsdp_state  # type: ignore[attr-defined]
    if state.group is None:
        return
    # the load copies into the registered parameters: the sharded ones, never unsharded
    # copies that the next reshard would drop
    state.group.reshard()
    ours = {id(p.sharded_param): p for p in state.group.params}
    convert = get_plugin_manager().hook.hyperfsdp_load_convert
    for name, param in module.named_parameters(remove_duplicate=False):
        p = ours.get(id(param))
        key = prefix + name
        if p is None or key not in state_dict:
            continue
        value = state_dict[key]
        if (
            isinstance(value, DTensor)
            and tuple(value.placements) == p.placements
            and value.device_mesh == p.dtensor_mesh
        ):
            continue
        converted = convert(param=p.view, value=value)
        if converted is not None:
            state_dict[key] = converted


def _reset_after_load(module: nn.Module, incompatible_keys) -> None:
    state = module._hyperfsdp_state  # type: ignore[attr-defined]
    if state.group is not None:
        state.reset_sharded_params()
    get_plugin_manager().hook.hyperfsdp_state_dict_post_load(unit=state.view)
