"""Rebuilding a unit's sharded storage around new shards (after load, ``to()``, ``to_empty()``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch
from torch.distributed.tensor import DTensor

from .spec import UnitSpec

if TYPE_CHECKING:
    from .param import ShardedParam
    from .port import PluginPort
    from .unit_params import UnitParams


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


def _in_place(p: ShardedParam, registered, local: torch.Tensor) -> bool:
    """Whether ``registered`` is still ``p``'s sharded parameter over its own slot of the
    bucket's flat buffer (a load that copied into it, or a conversion that changed nothing)."""
    slot = p.padded_slot
    if (
        registered is not p.sharded_param
        or slot is None
        or local.dtype != slot.dtype
        or local.device != slot.device
    ):
        return False
    # an empty shard (0 rows on this rank) holds nothing to keep
    return local.numel() == 0 or (local.data_ptr() == slot.data_ptr() and local.is_contiguous())


def _unit_spec_now(group: UnitParams, spec: UnitSpec, fqns: tuple[str, ...]) -> UnitSpec:
    """The unit's ``fully_shard`` spec with its parameters as registered now (the objects a
    load with ``assign=True`` may have replaced), for ``hyperfsdp_param_dtypes``."""
    return attrs.evolve(
        spec,
        named_params=tuple(zip(fqns, (p.sharded_param for p in group.params))),
        replicate_params=frozenset(
            p.sharded_param for p in group.params if p.mesh_info.kind == "DDP"
        ),
    )


def _decide_dtypes_again(spec: UnitSpec, params: list[ShardedParam], port: PluginPort) -> None:
    """Ask ``hyperfsdp_param_dtypes`` again for parameters a conversion gave a new dtype.

    A policy's ``param_dtype=None`` / ``reduce_dtype=None`` follow the parameter's dtype,
    the new one after ``model.to(torch.bfloat16)``; a dtype the policy names stays (FSDP2
    derives both from the policy and the parameter's dtype at lazy init).
    """
    for p in params:
        p.retype(*port.param_dtypes(spec, p.sharded_param))


def rebuild_storage(
    group: UnitParams, spec: UnitSpec, fqns: tuple[str, ...], port: PluginPort
) -> bool:
    """Rebuild the unit's flat sharded storage around its currently registered parameters;
    whether it was rebuilt (the caller then prepares the unit's plans again).

    A ``load_state_dict`` that copied into the sharded parameters (the default) leaves
    every local tensor a view of its slot: the storage stays as it is (same
    ``data_ptr``, padding untouched). After ``load_state_dict(assign=True)`` the
    registered Parameter objects are new; after ``_apply`` (``to``, ``to_empty``,
    dtype casts) their local tensors are. Then the actual shards are copied into fresh
    padded storage (padding zeroed), the parameters' local tensors become views of it,
    and a parameter whose dtype changed has its compute and reduce dtypes decided again.
    """
    group.reshard()
    locals_by_param = {}
    moved = False
    for p in group.params:
        registered = p.registered()
        local = _validated_local(p, registered)
        moved = moved or not _in_place(p, registered, local)
        locals_by_param[id(p)] = local.detach()
    if moved:
        _rebuild(group, locals_by_param, spec, fqns, port)
    return moved


def announce_reset(group: UnitParams, port: PluginPort) -> None:
    """``hyperfsdp_param_reset`` for every parameter, after :func:`rebuild_storage`."""
    for p in group.params:
        port.param_reset(p.view)


def _rebuild(
    group: UnitParams,
    locals_by_param: dict[int, torch.Tensor],
    spec: UnitSpec,
    fqns: tuple[str, ...],
    port: PluginPort,
) -> None:
    retyped = []
    for p in group.params:
        registered = p.registered()
        if registered is not p.sharded_param:
            p.adopt(registered)
        p.decide_extension()  # methods attached to the old local tensor went with it
        if locals_by_param[id(p)].dtype != p.orig_dtype:
            retyped.append(p)
    if retyped:
        _decide_dtypes_again(_unit_spec_now(group, spec, fqns), retyped, port)
    first = next(iter(locals_by_param.values()))
    device = (
        torch.device("meta") if any(t.is_meta for t in locals_by_param.values()) else first.device
    )
    group.rebucket()  # dtypes may have changed
    group.build_sharded(locals_by_param, device)
