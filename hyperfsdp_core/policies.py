"""Frozen policy records passed to :func:`fully_shard` (names and meaning as in FSDP2)."""

from __future__ import annotations

import dataclasses

import attrs
import torch
from attrs import validators as v

from ._torch_private import torch_fsdp2_objects

_opt_dtype = v.optional(v.instance_of(torch.dtype))


@attrs.frozen
class MixedPrecisionPolicy:
    """Module-level mixed precision, with FSDP2's semantics.

    ``param_dtype``: dtype of the unsharded parameters (all-gather and compute).
    ``reduce_dtype``: dtype of gradient reduction; ``None`` means the compute dtype.
    ``output_dtype``: dtype floating-point forward outputs are cast to.
    ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = attrs.field(default=None, validator=_opt_dtype)
    reduce_dtype: torch.dtype | None = attrs.field(default=None, validator=_opt_dtype)
    output_dtype: torch.dtype | None = attrs.field(default=None, validator=_opt_dtype)
    cast_forward_inputs: bool = attrs.field(default=True, validator=v.instance_of(bool))


@attrs.frozen
class OffloadPolicy:
    """No offloading (the default ``offload_policy``)."""


@attrs.frozen
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on the host.

    Needs the ``offload`` plugin (``pip install hyperfsdp[offload]``).
    """

    pin_memory: bool = attrs.field(default=True, validator=v.instance_of(bool))


def _dims(value):
    if value is None or isinstance(value, str):
        return value
    return tuple(value)


@attrs.frozen
class DataParallelMeshDims:
    """Which dims of a full SPMD mesh are data parallel (as in FSDP2).

    ``shard``: mesh dim name(s) FSDP shards over (several are flattened).
    ``replicate``: mesh dim name(s) for HSDP/DDP replication (several are flattened).
    """

    shard: str | tuple[str, ...] | None = attrs.field(default=None, converter=_dims)
    replicate: str | tuple[str, ...] | None = attrs.field(default=None, converter=_dims)

    def __attrs_post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs at least one of shard= or replicate=")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _as_names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _as_names(self.replicate)


def _as_names(value) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


# -- torch's own FSDP2 policy objects -------------------------------------------------------------
#
# Frameworks build torch's policy objects themselves (accelerate's FSDP2 plugin always passes
# torch's ``OffloadPolicy()``), so ``fully_shard`` accepts them wherever it accepts its own and
# turns them into these records, with the same meaning. torch's classes are found where torch
# defines them, which ``use_as_fsdp2()`` leaves alone.


def _torch_class(name: str) -> type | None:
    return torch_fsdp2_objects().get(name)  # type: ignore[return-value]


def as_mp_policy(policy) -> MixedPrecisionPolicy:
    """``fully_shard(mp_policy=...)`` as this module's record: hyperfsdp's as is, torch's
    ``MixedPrecisionPolicy`` field by field, ``None`` as the default (no mixed precision)."""
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    theirs = _torch_class("MixedPrecisionPolicy")
    if theirs is not None and isinstance(policy, theirs):
        return MixedPrecisionPolicy(**_fields_of(policy, MixedPrecisionPolicy, theirs))
    raise TypeError(
        "fully_shard(mp_policy=...) expects a MixedPrecisionPolicy (hyperfsdp_core's or "
        f"torch.distributed.fsdp's), got {policy!r} of type {type(policy).__qualname__}"
    )


def as_offload_policy(policy) -> OffloadPolicy:
    """``fully_shard(offload_policy=...)`` as this module's record: hyperfsdp's as is (a
    third-party plugin's subclass included), torch's ``CPUOffloadPolicy`` as
    :class:`CPUOffloadPolicy` with its ``pin_memory``, any other torch ``OffloadPolicy`` as
    :class:`OffloadPolicy` (FSDP2 offloads only for ``CPUOffloadPolicy``), ``None`` as the
    default (no offload, as FSDP2 treats it)."""
    if policy is None:
        return OffloadPolicy()
    if isinstance(policy, OffloadPolicy):
        return policy
    cpu, base = _torch_class("CPUOffloadPolicy"), _torch_class("OffloadPolicy")
    if cpu is not None and isinstance(policy, cpu):
        return CPUOffloadPolicy(pin_memory=bool(policy.pin_memory))
    if base is not None and isinstance(policy, base):
        return OffloadPolicy()
    raise TypeError(
        "fully_shard(offload_policy=...) expects an OffloadPolicy or CPUOffloadPolicy "
        f"(hyperfsdp_core's or torch.distributed.fsdp's), got {policy!r} of type "
        f"{type(policy).__qualname__}"
    )


def as_dp_mesh_dims(dims) -> DataParallelMeshDims | None:
    """``fully_shard(dp_mesh_dims=...)`` as this module's record: ``None`` and hyperfsdp's
    as they are, torch's ``DataParallelMeshDims`` field by field."""
    if dims is None or isinstance(dims, DataParallelMeshDims):
        return dims
    theirs = _torch_class("DataParallelMeshDims")
    if theirs is not None and isinstance(dims, theirs):
        return DataParallelMeshDims(**_fields_of(dims, DataParallelMeshDims, theirs))
    raise TypeError(
        "fully_shard(dp_mesh_dims=...) expects a DataParallelMeshDims (hyperfsdp_core's or "
        f"torch.distributed.fsdp's) or None, got {dims!r} of type {type(dims).__qualname__}"
    )


def _fields_of(policy, ours: type, theirs: type) -> dict:
    """``policy``'s fields that ``ours`` has; a field only torch's class has must hold its
    default (a newer torch's option this version does not implement is an error, not ignored)."""
    names = {a.name for a in attrs.fields(ours)}
    values = {}
    for field in dataclasses.fields(theirs):
        value = getattr(policy, field.name)
        if field.name in names:
            values[field.name] = value
        elif field.default is dataclasses.MISSING or value != field.default:
            raise ValueError(
                f"torch's {theirs.__name__}({field.name}={value!r}) is not supported by "
                f"hyperfsdp's {ours.__name__}, which has the fields {sorted(names)}"
            )
    return values
