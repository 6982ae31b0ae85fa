"""Rebuilding a unit's sharded storage around new shards (after load, ``to()``, ``to_empty()``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ._plugins import get_plugin_manager

if TYPE_CHECKING:
    from ._state import FSDPState


def _validated_local(p, registered) -> torch.Tensor:
    """``registered``'s local tensor, after checking it is a DTensor with ``p``'s spec."""
    if not isinstance(registered, DTensor):
        raise ValueError(
            f"parameter {p.fqn!r} was replaced by a {type(registered).__name__}; a sharded "
            "module needs DTensor parameters (load a sharded state dict, e.g. from "
            "model.state_dict() or torch.distributed.checkpoint)"
        )
    if (
        registered.shape != torch.Size(p.global_shape)
        or tuple(registered.placements) != p.placements
    ):
        raise ValueError(
            f"parameter {p.fqn!r}: expected a DTensor of global shape {p.global_shape} with "
            f"placements {p.placements}, got {tuple(registered.shape)} with "
            f"{tuple(registered.placements)}"
        )
    local = registered.to_local()
    if tuple(local.shape) != p.layout.actual_shape:
        raise ValueError(
            f"parameter {p.fqn!r}: local shard has shape {tuple(local.shape)}, expected "
            f"{p.layout.actual_shape} on this rank"
        )
    return local


def reset_sharded_params(state: FSDPState) -> None:
    """Rebuild the unit's flat sharded storage around its currently registered parameters.

    After ``load_state_dict(assign=True)`` the registered Parameter objects are new;
    after ``_apply`` (``to``, ``to_empty``, dtype casts) their local tensors are. Either
    way the actual shards are copied into fresh padded storage (padding zeroed) and the
    parameters' local tensors become views of it.
    """
    group = state.group
    assert group is not None
    group.reshard()
    locals_by_param = {}
    for p in group.params:
        local = _validated_local(p, p.registered())
        if p.registered() is not p.sharded_param:
            p.sharded_param = p.registered()
        if local.dtype != p.orig_dtype:
            same = p.param_dtype == p.orig_dtype
            p.orig_dtype = local.dtype
            if same:
                p.param_dtype = p.reduce_dtype = local.dtype
        locals_by_param[id(p)] = local.detach()
    first = next(iter(locals_by_param.values()))
    device = (
        torch.device("meta") if any(t.is_meta for t in locals_by_param.values()) else first.device
    )
    group.rebucket()  # dtypes may have changed
    group.build_sharded(locals_by_param, device)
    if state.ctx is not None:
        state.prepare_group()
    hook = get_plugin_manager().hook.hyperfsdp_param_reset
    for p in group.params:
        hook(param=p.view)
