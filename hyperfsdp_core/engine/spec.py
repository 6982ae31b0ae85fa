"""UnitSpec: what one ``fully_shard`` call asked for, as seen by validation hooks."""

from __future__ import annotations

from collections.abc import Callable

import attrs
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..policies import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy


@attrs.frozen(eq=False)
class UnitSpec:
    """One ``fully_shard`` call: its modules, the parameters it will manage, and its options.

    ``named_params`` lists ``(fqn, param)`` pairs with FQNs relative to the unit's module
    (prefixed ``[i].`` for the i-th module of a list unit).
    """

    modules: tuple[nn.Module, ...]
    named_params: tuple[tuple[str, nn.Parameter], ...]
    mesh: DeviceMesh
    reshard_after_forward: bool | int | None
    shard_placement_fn: Callable | None
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    dp_mesh_dims: DataParallelMeshDims | None
    replicate_params: frozenset[nn.Parameter]
    mesh_was_default: bool = False

    def fqn_of(self, param: nn.Parameter) -> str:
        for fqn, p in self.named_params:
            if p is param:
                return fqn
        return "<unknown>"
