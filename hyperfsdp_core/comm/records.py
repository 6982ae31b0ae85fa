"""Records the communication layer hands out: what an observer sees of a collective, and
what a transport reports putting on the wire (:func:`report_wire`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import torch


@attrs.frozen
class CollectiveEvent:
    """One collective issued by the core (or through the plugin communication facade),
    seen by observers right after its transport issued it.

    ``kind``: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` or ``"broadcast"``.
    ``group_size``: ranks in the process group. ``nbytes`` and ``dtype``: the logical
    collective the core asked for: bytes of the larger side (the all-gather output, the
    reduce-scatter input, the all-reduced tensor) and its dtype. ``unit``: FQN of the unit
    it belongs to (``""`` for the root, ``None`` when the caller did not say).
    ``wire_nbytes`` and ``wire_dtype``: what the transport put on the wire, as it reported
    with :func:`report_wire` (the sum of the reported tensors' bytes; their dtype, ``None``
    if they differ); the logical ``nbytes`` and ``dtype`` where it reported nothing.
    """

    kind: str
    group_size: int
    nbytes: int
    dtype: torch.dtype
    unit: str | None
    wire_nbytes: int = attrs.field(
        default=attrs.Factory(lambda self: self.nbytes, takes_self=True), kw_only=True
    )
    wire_dtype: torch.dtype | None = attrs.field(
        default=attrs.Factory(lambda self: self.dtype, takes_self=True), kw_only=True
    )


_reports = threading.local()  # .tensors: what the current collective's transport reported


def report_wire(*tensors: torch.Tensor) -> None:
    """Called by a transport inside a collective the core issued: ``tensors`` are what it
    puts on the wire (a compressed all-gather's gathered output, say), reported to the
    ``hyperfsdp_collective_observer`` observers as the event's ``wire_nbytes`` and
    ``wire_dtype``. Report the larger side, as ``nbytes`` counts it; several calls add up.
    Outside such a collective (the same comm object under torch's FSDP2) it does nothing."""
    current = getattr(_reports, "tensors", None)
    if current is not None:
        current.extend(tensors)


@contextmanager
def wire_reports() -> Iterator[list[torch.Tensor]]:
    """Collect what :func:`report_wire` is told during the block (per thread; nested blocks
    each see their own)."""
    outer = getattr(_reports, "tensors", None)
    _reports.tensors = reported = []
    try:
        yield reported
    finally:
        _reports.tensors = outer


def observed_event(what: tuple, group_size: int, reported: list[torch.Tensor]) -> CollectiveEvent:
    """The event of the collective ``what`` (kind, unit, tensor, group) whose transport
    reported ``reported``."""
    kind, unit, tensor, _ = what
    wire = {}
    if reported:
        dtypes = {t.dtype for t in reported}
        wire["wire_nbytes"] = sum(t.numel() * t.element_size() for t in reported)
        wire["wire_dtype"] = dtypes.pop() if len(dtypes) == 1 else None
    nbytes = tensor.numel() * tensor.element_size()
    return CollectiveEvent(kind, group_size, nbytes, tensor.dtype, unit, **wire)
