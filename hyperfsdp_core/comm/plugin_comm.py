"""The communication facade plugins use: :class:`PluginComm` (``root.comm``) and the
:data:`Work` its methods return."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .handles import Handle

if TYPE_CHECKING:
    from .comm import Comm


class PluginComm:
    """The communication facade plugins use (``root.comm``): one async collective per call.

    Every method issues the collective and returns a :class:`Work` to ``wait()`` on.
    On CPU (gloo) the collective runs on the backend's threads while the caller goes
    on; on accelerators it runs on the core's communication stream, ordered after
    the work already queued on the current stream, and ``wait()`` makes the current
    stream wait for it (the host does not block). Tensors passed in are kept alive
    until the work is waited for. ``unit`` (a unit's ``fqn``) labels the collective
    for ``hyperfsdp_collective_observer`` and runs it on that unit's transport
    (``hyperfsdp_transport``) where a plugin gave one; counts appear in the core's
    statistics.
    """

    __slots__ = ("_hyperfsdp_comm",)

    def __init__(self, comm: Comm) -> None:
        self._hyperfsdp_comm = comm

    @property
    def device(self) -> torch.device:
        """The device collectives run on (CPU for gloo)."""
        return self._hyperfsdp_comm.device

    def all_reduce(
        self, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, *, unit: str | None = None
    ) -> Work:
        """All-reduce ``tensor`` in place over ``group``."""
        comm = self._hyperfsdp_comm
        return comm.all_reduce(tensor, group, op, comm.unit_transport(unit), unit=unit)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group, *, unit: str | None = None
    ) -> Work:
        """Gather every rank's ``input`` into ``output`` (``group size * input.numel()``
        elements, rank-major)."""
        comm = self._hyperfsdp_comm
        return comm.all_gather(output, input, group, comm.unit_transport(unit), unit=unit)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group,
        op=dist.ReduceOp.SUM,
        *,
        unit: str | None = None,
    ) -> Work:
        """Reduce ``input`` over ``group`` and keep this rank's slice in ``output``."""
        comm = self._hyperfsdp_comm
        transport = comm.unit_transport(unit)
        return comm.reduce_scatter(output, input, group, op, transport, unit=unit)

    def broadcast(self, tensor: torch.Tensor, src: int, group, *, unit: str | None = None) -> Work:
        """Broadcast ``tensor`` from group rank ``src`` to every rank of ``group``."""
        return self._hyperfsdp_comm.broadcast(tensor, src, group, unit=unit)


#: What :class:`PluginComm` methods return: ``wait()`` (idempotent) makes the result
#: usable by the current stream; ``abandon()`` waits ignoring errors (for ``reset()``).
Work = Handle
