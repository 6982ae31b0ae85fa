"""Frozen records that plugins return from hooks or receive from the core (public via ``plugin``)."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh

from .layout import contiguous_strides


def _shape(value) -> tuple[int, ...]:
    return tuple(int(x) for x in value)


@attrs.frozen(eq=False)
class ParamLayout:
    """How one parameter is sharded: returned by ``hyperfsdp_param_layout``.

    ``tensor`` is the plain tensor the core shards over the parameter's shard group
    (the parameter itself for FSDP/HSDP; a tensor-parallel parameter's local tensor
    under TP) and all-gathers back; its shape is the *unsharded shape*. The sharded
    parameter becomes a DTensor on ``mesh`` with ``placements`` and the logical
    ``global_shape``/``global_stride``, around this rank's actual shard of ``tensor``.

    ``wrap_unsharded(t)`` turns the all-gathered plain tensor (a view of the
    communication buffer, ``tensor``'s shape) into what the module computes with,
    without copying (e.g. a DTensor on the TP mesh); it is called once per
    unsharded storage, not per step. ``unwrap_grad(g)`` turns the gradient autograd
    accumulated on that unsharded parameter back into a plain tensor of the unsharded
    shape, per parameter per backward. Both default to the identity.
    """

    tensor: torch.Tensor = attrs.field(eq=False)
    mesh: DeviceMesh = attrs.field(eq=False)
    placements: tuple = attrs.field(converter=tuple)
    global_shape: tuple[int, ...] = attrs.field(converter=_shape)
    global_stride: tuple[int, ...] = attrs.field(
        default=None, converter=attrs.converters.optional(_shape)
    )
    wrap_unsharded: Callable[[torch.Tensor], torch.Tensor] | None = attrs.field(
        default=None, eq=False
    )
    unwrap_grad: Callable[[torch.Tensor], torch.Tensor] | None = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.global_stride is None:
            object.__setattr__(self, "global_stride", contiguous_strides(self.global_shape))


@attrs.frozen
class ShardedStorage:
    """Where a unit's sharded storage lives: returned by ``hyperfsdp_sharded_storage``.

    ``device`` holds the flat sharded buffers (and so the optimizer's parameters,
    gradients and state); ``pin_memory`` pins them (host storage next to an
    accelerator, for asynchronous copies).
    """

    device: torch.device = attrs.field(converter=torch.device)
    pin_memory: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
