"""Records the communication layer hands out: what an observer sees of a collective."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class CollectiveEvent:
    """One collective issued by the core (or through the plugin communication facade).

    ``kind``: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` or ``"broadcast"``.
    ``group_size``: ranks in the process group. ``nbytes``: bytes of the larger side
    (the all-gather output, the reduce-scatter input, the all-reduced tensor).
    ``dtype``: the communicated dtype. ``unit``: FQN of the unit it belongs to (``""``
    for the root, ``None`` when the caller did not say).
    """

    kind: str
    group_size: int
    nbytes: int
    dtype: torch.dtype
    unit: str | None
