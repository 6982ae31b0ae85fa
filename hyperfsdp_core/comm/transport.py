"""The communication seam: :class:`Transport`, how a unit's collectives move bytes.

A bucket asks its transport once per collective: a unit's own (a plugin's
``hyperfsdp_transport``, FSDP2's ``set_custom_*`` comm objects, composed by
:func:`compose_transport`), else the root's default: on CPU :class:`~.gloo.GlooTransport`
(gloo without its full-size buffers), elsewhere this module's :class:`Transport`,
torch.distributed's own collectives (the ``hyperfsdp-shm`` plugin adds shared memory on CPU
through the same seam). The transport picks the route; :class:`~.comm.Comm` issues it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_reduce = dist.all_reduce


class Transport:
    """How a unit's collectives move bytes: the communication seam (``plugin.Transport``).

    A bucket asks its transport once per collective, and the transport picks its route.
    Built from FSDP2 comm objects (``torch.distributed.fsdp``'s ``AllGather`` and
    ``ReduceScatter``: ``allocate(sizes, *, dtype, device)`` plus ``__call__``), so any
    FSDP2 custom comm works as a transport, and an ``all_reduce(tensor, group, op,
    async_op=)`` callable; a part left ``None`` is ``torch.distributed``'s own collective
    (or, for the core's composition of ``set_custom_*`` with a plugin's transport, the
    ``fallback`` transport's). A collective returns a ``Work`` (waited for by the core) or
    ``None`` when it completed in the call. A plugin returns one from the
    ``hyperfsdp_transport`` hook (docs/plugin_hooks.md), or subclasses it to route by
    group, size or dtype.

    Transports that can gather straight into a unit's own (param-major) unsharded buffer,
    without a rank-major staging buffer, override :meth:`gather_route` and the matching
    :meth:`all_gather_rows` / :meth:`all_gather_in_place`; a transport whose collectives
    complete when issued says so in :meth:`gathers_in_line` (the core then does not
    prefetch them: it would overlap nothing).
    """

    def __init__(
        self,
        all_gather=None,
        reduce_scatter=None,
        all_reduce: Callable | None = None,
        *,
        fallback: Transport | None = None,
    ) -> None:
        self.all_gather_comm = all_gather
        self.reduce_scatter_comm = reduce_scatter
        self.all_reduce_fn = all_reduce
        self.fallback = fallback

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(all_gather={self.all_gather_comm!r}, "
            f"reduce_scatter={self.reduce_scatter_comm!r}, all_reduce={self.all_reduce_fn!r}, "
            f"fallback={self.fallback!r})"
        )

    # -- buffers -------------------------------------------------------------------------
    def allocator(self, use: str):
        """The comm object whose ``allocate`` makes the buffers of ``use`` (``"gather"``:
        all-gather outputs, ``"reduce"``: reduce-scatter inputs), or ``None``: the core's
        own pooled buffers."""
        comm = self.all_gather_comm if use == "gather" else self.reduce_scatter_comm
        if comm is not None:
            return comm
        return self.fallback.allocator(use) if self.fallback is not None else None

    # -- the collectives -----------------------------------------------------------------
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
        """Gather every rank's ``input`` into ``output`` (rank-major)."""
        if self.all_gather_comm is not None:
            return self.all_gather_comm(output, input, group, async_op=async_op)
        if self.fallback is not None:
            return self.fallback.all_gather(output, input, group, async_op)
        return _all_gather(output, input, group=group, async_op=async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group,
        op,
        async_op: bool,
        *,
        scratch_input: bool = False,
    ):
        """Reduce ``input`` over ``group``; this rank's chunk into ``output``.
        ``scratch_input``: the caller gives ``input`` up (the transport may overwrite it)."""
        if self.reduce_scatter_comm is not None:
            return self.reduce_scatter_comm(output, input, group, op, async_op=async_op)
        if self.fallback is not None:
            return self.fallback.reduce_scatter(
                output, input, group, op, async_op, scratch_input=scratch_input
            )
        return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, group, op, async_op: bool):
        """All-reduce ``tensor`` in place over ``group``."""
        if self.all_reduce_fn is not None:
            return self.all_reduce_fn(tensor, group, op, async_op=async_op)
        if self.fallback is not None:
            return self.fallback.all_reduce(tensor, group, op, async_op)
        return _all_reduce(tensor, op=op, group=group, async_op=async_op)

    # -- gathers into the unit's own layout (optional) -----------------------------------
    def gather_route(self, group, nbytes: int, rows: bool) -> str:
        """How an all-gather of ``nbytes`` (unsharded) over ``group`` runs: ``"native"``
        (:meth:`all_gather` into a rank-major buffer, copied out), ``"rows"``
        (:meth:`all_gather_rows`; only where ``rows``: every member is sharded on dim 0)
        or ``"in_place"`` (:meth:`all_gather_in_place`). Asked only when the all-gather
        input is the sharded storage itself (no plugin fills it)."""
        if self.all_gather_comm is None and self.fallback is not None:
            return self.fallback.gather_route(group, nbytes, rows)
        return "native"

    def all_gather_rows(self, rows: list[torch.Tensor], rank: int, group):
        """Gather into ``(world, n)`` views of the unsharded buffer whose row ``rank`` this
        rank has written: every peer's row of each view, into place."""
        if self.fallback is None:
            raise NotImplementedError(f"{type(self).__name__} has no 'rows' all-gather")
        return self.fallback.all_gather_rows(rows, rank, group)

    def all_gather_in_place(self, buffer: torch.Tensor, group):
        """Gather into ``buffer`` in its own layout: this rank has written its parts and
        zeroed the rest."""
        if self.fallback is None:
            raise NotImplementedError(f"{type(self).__name__} has no in-place all-gather")
        return self.fallback.all_gather_in_place(buffer, group)

    def gathers_in_line(self, group) -> bool:
        """Whether an all-gather over ``group`` completes in the call that issues it. Must
        not itself run a collective (it is asked inside decisions)."""
        if self.all_gather_comm is None and self.fallback is not None:
            return self.fallback.gathers_in_line(group)
        return False


def compose_transport(
    all_gather=None, reduce_scatter=None, transport: Transport | None = None
) -> Transport | None:
    """A unit's transport: FSDP2 comm objects (``set_custom_all_gather`` /
    ``set_custom_reduce_scatter``) over a plugin's ``transport``; ``None`` where neither is
    given (the root's default transport)."""
    if all_gather is None and reduce_scatter is None:
        return transport
    return Transport(all_gather, reduce_scatter, fallback=transport)
