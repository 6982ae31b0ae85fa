"""The plugin's transport on CPU (gloo) groups: shared memory between the ranks of one
host, else the core's own gloo routes (``hyperfsdp_core.plugin.GlooTransport``: gloo's
collectives without its full-size buffers), which :class:`ShmTransport` extends.

Between the ranks of one host all-gathers and sum-reduce-scatters go through shared memory
(``_shm.py``), decided per group at its first collective.

Switches (``HYPERFSDP_SHM=0``): ``_settings.py``. Figures: docs/performance.md.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from hyperfsdp_core.plugin import GlooTransport, group_timeout, modes_set_aside

from ._backend import BACKEND, ShmProcessGroup
from ._settings import use_shm


# -- through shared memory (``_shm.ShmGroup``; done when issued) -------------------------------
def all_gather_shm(out: torch.Tensor, inp: torch.Tensor, group, shm) -> None:
    shm.all_gather(out, inp)


def all_gather_rows_shm(rows: list[torch.Tensor], group, shm) -> None:
    shm.all_gather_rows(rows)


def reduce_scatter_shm(output: torch.Tensor, input: torch.Tensor, op, group, shm) -> None:
    """In gloo's order of additions (``op`` is ``SUM``; over more than two ranks only
    where ``shm.ring_order``)."""
    shm.reduce_scatter(output, input)


class ShmTransport(GlooTransport):
    """One root's transport (``hyperfsdp_transport``): shared memory between the ranks of
    one host, else the core's gloo routes (``GlooTransport``), else torch.distributed's
    own. Holds the root's shared-memory groups, made at each group's first collective
    (collective itself).

    A collective's route depends only on what every member agrees on (the group, the
    settings, the sizes; whether the shared memory could be set up is agreed at its setup),
    never on this rank's torch dispatch modes. While a mode is active, a collective that
    goes through shared memory is shown to it as the c10d op FSDP2 issues for it
    (``GlooTransport.shown_all_gather``), and the copies and the setup run with the modes
    set aside.
    """

    BACKENDS = ("gloo", BACKEND)

    def __init__(self, shm: bool | None = None, min_bytes: int | None = None) -> None:
        super().__init__(min_bytes)
        self.use_shm = use_shm() if shm is None else shm
        self._shm: dict = {}  # group -> ShmGroup, or None where gloo is kept

    def __repr__(self) -> str:
        return f"ShmTransport(shm={self.use_shm}, min_bytes={self.all_gather_min_bytes})"

    # -- per group ------------------------------------------------------------------------
    def shm(self, group):
        """``group``'s shared-memory group, or None (not gloo, one rank, shared memory off,
        or some member cannot map the others' memory). Made at the group's first
        collective, which every member reaches at the same point; its setup's own
        collectives run with any dispatch mode set aside."""
        if group in self._shm:
            return self._shm[group]
        made = None
        with modes_set_aside():
            if isinstance(group, ShmProcessGroup):  # the group's own, shared with its users
                made = group.transport if self.use_shm else None
            elif self.use_shm and self.is_gloo(group):
                rank, world = self.place(group)
                if world > 1:
                    from ._shm import ShmGroup

                    made = ShmGroup.create(group, rank, world, group_timeout(group))
        self._shm[group] = made
        return made

    def shm_made(self, group):
        """What :meth:`shm` returns, if made already (never makes it: that is collective)."""
        if group in self._shm:
            return self._shm[group]
        if isinstance(group, ShmProcessGroup) and self.use_shm:
            return group.made_transport
        return None

    # -- the seam -------------------------------------------------------------------------
    def gather_route(self, group, nbytes: int, rows: bool) -> str:
        if self.is_gloo(group) and self.shm(group) is not None:
            return "rows" if rows else "native"
        return super().gather_route(group, nbytes, rows)

    def gathers_in_line(self, group) -> bool:
        # only a group already made: making one is a collective, never run from a decision
        return self.shm_made(group) is not None

    def all_gather(self, output, input, group, async_op):
        shm = self.shm(group)
        if shm is None:
            return super().all_gather(output, input, group, async_op)
        return self.shown_all_gather(
            partial(all_gather_shm, output, input, group, shm),
            output.numel(),
            output.dtype,
            group,
            async_op,
        )

    def all_gather_rows(self, rows, rank, group):
        shm = self.shm(group)
        if shm is None:
            return super().all_gather_rows(rows, rank, group)
        return self.shown_rows(partial(all_gather_rows_shm, rows, group, shm), rows, group)

    def reduce_scatter(self, output, input, group, op, async_op, *, scratch_input=False):
        if op == dist.ReduceOp.SUM and input.is_contiguous():
            shm = self.shm(group)
            if shm is not None and shm.ring_order:
                return self.shown_reduce_scatter(
                    partial(reduce_scatter_shm, output, input, op, group, shm),
                    input.numel(),
                    input.dtype,
                    group,
                    op,
                    async_op,
                )
        return super().reduce_scatter(
            output, input, group, op, async_op, scratch_input=scratch_input
        )
