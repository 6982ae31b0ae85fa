"""A unit's options: what ``fully_shard`` and the ``FSDPModule`` setters decide, as one frozen
record apart from the per-iteration state (``UnitState.set_options`` replaces it)."""

from __future__ import annotations

from typing import Any

import attrs

from .spec import UnitSpec


@attrs.frozen
class UnitOptions:
    """One unit's options (FSDP2's setters of the same names change them)."""

    #: reshard after forward: ``True``, ``False``, or the size of the smaller group to keep
    reshard_after_forward: bool | int = True
    #: ``fully_shard(reshard_after_forward=None)``: the root keeps its parameters (``False``)
    auto_reshard_after_forward: bool = False
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    reduce_scatter_unused_params: bool = False
    unshard_in_backward: bool = True
    #: explicit prefetch targets (``set_modules_to_*_prefetch``); ``None``: the recorded order
    forward_prefetch: tuple[Any, ...] | None = None
    backward_prefetch: tuple[Any, ...] | None = None
    #: reduce-scatters in flight before a post-backward waits for the oldest
    max_reduce_buffers: int = 1
    mp_policy: Any = None
    offload_policy: Any = None
    #: the ``fully_shard`` call without its parameters (for hooks asked again later)
    unit_spec: UnitSpec | None = None
    #: the FQNs of the unit's parameters relative to the unit, in order
    unit_fqns: tuple[str, ...] = ()
