"""Frozen policy records passed to :func:`fully_shard` (names and meaning as in FSDP2)."""

from __future__ import annotations

import attrs
import torch
from attrs import validators as v

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
