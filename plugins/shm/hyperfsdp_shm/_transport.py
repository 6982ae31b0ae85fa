"""The plugin's transport on CPU (gloo) groups: shared memory between the ranks of one
host, else the gloo stand-ins, else gloo's own collectives.

gloo's ``all_gather_into_tensor`` (and its list form) gathers into a full-size buffer of
its own and copies out of it, and its ``reduce_scatter_tensor`` is a full-size clone of
the input, an all-reduce of the clone and a copy of this rank's chunk. The stand-ins
avoid both: all-gathers of ``GLOO_ALL_GATHER_MIN_BYTES`` and more go straight into the
unit's unsharded buffer, point-to-point (:func:`all_gather_p2p`, every member on dim 0)
or as an integer all-reduce (:func:`all_gather_by_all_reduce`); sum-reduce-scatters are
point-to-point over two ranks (:func:`reduce_scatter_pair`) and an all-reduce in place on
the engine's own pack over more (:func:`reduce_scatter_in_place`). Every one gives gloo's
own results bit for bit. Between the ranks of one host all-gathers and sum-reduce-scatters
go through shared memory instead (``_shm.py``), decided per group at its first collective.

Switches (``HYPERFSDP_SHM=0`` and others): ``_settings.py``. Figures: docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from hyperfsdp_core.plugin import Transport, group_timeout

from ._backend import BACKEND, ShmProcessGroup
from ._settings import settings
from ._torch_private import (
    dispatch_mode_active,
    modes_set_aside,
    show_all_gather,
    show_reduce_scatter,
)

#: point-to-point forms (:func:`all_gather_p2p`, :func:`reduce_scatter_pair`) where they
#: apply: plain copies (and one addition), half the bytes of an all-reduce
GLOO_P2P_ALL_GATHER = True


# -- the gloo stand-ins ----------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers gloo can sum (it has no 16-bit integer type)."""
    if (t.numel() * t.element_size()) % 4 == 0:
        try:
            return t.view(torch.int32)
        except RuntimeError:  # storage offset not 4-byte aligned
            pass
    return t.view(torch.uint8)


def all_gather_by_all_reduce(buffer: torch.Tensor, group, async_op: bool):
    """All-gather as an all-reduce: every rank has written its part of ``buffer`` and
    zeroed the rest. The sum runs on the bit patterns as integers, so every value, -0.0
    and NaN payloads included, arrives exactly as sent; gloo allocates nothing of the
    buffer's size."""
    return dist.all_reduce(_bits(buffer), op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class _Works:
    """Several works (point-to-point sends and receives) waited for as one."""

    __slots__ = ("_works",)

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self, timeout=None) -> bool:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        return True


def all_gather_p2p(rows: list[torch.Tensor], rank: int, group):
    """All-gather by point-to-point: ``rows`` are ``(world, n)`` views of the unsharded
    buffer whose row ``rank`` this rank has written; it sends that row to every peer and
    receives each peer's row into place. Tags tell a bucket's members apart; every rank
    posts in the same order, and gloo matches a (peer, tag) pair's messages in order."""
    world = rows[0].shape[0]
    works = []
    for step in range(1, world):
        src, dst = (rank - step) % world, (rank + step) % world
        for tag, r in enumerate(rows):
            works.append(dist.irecv(r[src], group=group, group_src=src, tag=tag))
            works.append(dist.isend(r[rank], group=group, group_dst=dst, tag=tag))
    return _Works(works)


class _ThenAfterWait:
    """A work handle that runs ``then`` once, after the wrapped work completes."""

    __slots__ = ("_then", "_work")

    def __init__(self, work, then: Callable[[], object]) -> None:
        self._work = work
        self._then = then

    def wait(self, timeout=None) -> bool:
        work, then = self._work, self._then
        if work is not None:
            self._work = self._then = None
            work.wait()
            with modes_set_aside():  # the route's own copy or addition
                then()
        return True


#: point-to-point tag of the pair reduce-scatter (the all-gathers use member indices)
_PAIR_REDUCE_TAG = 1 << 20


def reduce_scatter_pair(output: torch.Tensor, input: torch.Tensor, op, group, rank: int):
    """Sum-reduce-scatter over two ranks by point-to-point: send the peer its chunk,
    receive ours into ``output`` and add our own. One addition per element, as gloo's
    all-reduce makes for two ranks (it commutes bit for bit), with half its bytes and no
    full-size buffer. ``op`` must be ``SUM``; ``rank`` is this rank's in ``group``."""
    peer = 1 - rank
    chunks = input.view(2, -1)
    works = [
        dist.irecv(output, group=group, group_src=peer, tag=_PAIR_REDUCE_TAG),
        dist.isend(chunks[peer], group=group, group_dst=peer, tag=_PAIR_REDUCE_TAG),
    ]
    return _ThenAfterWait(_Works(works), partial(output.add_, chunks[rank]))


def reduce_scatter_in_place(output, input, op, group, async_op, rank: int, world: int):
    """gloo's ``reduce_scatter_tensor`` without its clone: the same all-reduce, in place on
    ``input`` (the caller gives it up), then this rank's chunk copied to ``output``."""
    work = dist.all_reduce(input, op=op, group=group, async_op=async_op)
    chunk = input.view(world, -1)[rank]
    if work is None:
        output.copy_(chunk)
        return None
    return _ThenAfterWait(work, partial(output.copy_, chunk))


# -- through shared memory (``_shm.ShmGroup``; done when issued) -------------------------------
def all_gather_shm(out: torch.Tensor, inp: torch.Tensor, group, shm) -> None:
    shm.all_gather(out, inp)


def all_gather_rows_shm(rows: list[torch.Tensor], group, shm) -> None:
    shm.all_gather_rows(rows)


def reduce_scatter_shm(output: torch.Tensor, input: torch.Tensor, op, group, shm) -> None:
    """In gloo's order of additions (``op`` is ``SUM``; over more than two ranks only
    where ``shm.ring_order``)."""
    shm.reduce_scatter(output, input)


def _gathered(rows: list[torch.Tensor]) -> tuple[int, torch.dtype]:
    """The elements and dtype of the one all-gather FSDP2 would issue for ``rows``."""
    dtypes = {r.dtype for r in rows}
    if len(dtypes) == 1:
        return sum(r.numel() for r in rows), rows[0].dtype
    return sum(r.numel() * r.element_size() for r in rows), torch.uint8


class ShmTransport(Transport):
    """One root's transport (``hyperfsdp_transport``): shared memory between the ranks of
    one host, else the gloo stand-ins, else gloo's own; on non-gloo groups
    torch.distributed's own. Holds the root's shared-memory groups, made at each group's
    first collective (collective itself).

    A collective's route depends only on what every member agrees on (the group, the
    settings, the sizes; whether the shared memory could be set up is agreed at its
    setup), never on this rank's torch dispatch modes: a mode entered on some ranks only
    (``FlopCounterMode``, ``CommDebugMode`` around one rank's step) must not make that
    rank's collectives meet different ones on its peers. While a mode is active, each
    collective that takes one of the plugin's own routes is shown to it as the c10d op
    FSDP2 issues for it (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``, on
    meta tensors of its sizes, which move nothing), and the route's workings (copies,
    point-to-point and all-reduce calls, setup) run with the modes set aside.
    """

    def __init__(self, shm: bool | None = None, min_bytes: int | None = None) -> None:
        super().__init__()
        _, env_min, env_shm = settings()
        self.use_shm = env_shm if shm is None else shm
        self.all_gather_min_bytes = env_min if min_bytes is None else min_bytes
        self.gloo_p2p = GLOO_P2P_ALL_GATHER
        self._is_gloo: dict = {}  # group -> whether its backend is gloo (or hyperfsdp_shm)
        self._places: dict = {}  # group -> (this rank in it, its size)
        self._shm: dict = {}  # group -> ShmGroup, or None where gloo is kept

    def __repr__(self) -> str:
        return f"ShmTransport(shm={self.use_shm}, min_bytes={self.all_gather_min_bytes})"

    # -- per group ------------------------------------------------------------------------
    def is_gloo(self, group) -> bool:
        known = self._is_gloo.get(group)
        if known is None:
            known = self._is_gloo[group] = dist.get_backend(group) in ("gloo", BACKEND)
        return known

    def place(self, group) -> tuple[int, int]:
        """This rank's rank in ``group`` and the group's size (looked up once)."""
        place = self._places.get(group)
        if place is None:
            place = self._places[group] = (dist.get_rank(group), dist.get_world_size(group))
        return place

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

    @staticmethod
    def _own(run: Callable, show: Callable[[], None]):
        """Run one of the plugin's own routes (``run``); while a dispatch mode is active,
        ``show`` it the collective first and run the route with the modes set aside."""
        if not dispatch_mode_active():
            return run()
        show()
        with modes_set_aside():
            return run()

    # -- the seam -------------------------------------------------------------------------
    def gather_route(self, group, nbytes: int, rows: bool) -> str:
        if not self.is_gloo(group):
            return "native"
        if self.shm(group) is not None:
            return "rows" if rows else "native"
        if nbytes < self.all_gather_min_bytes:
            return "native"
        return "rows" if rows and self.gloo_p2p else "in_place"

    def gathers_in_line(self, group) -> bool:
        # only a group already made: making one is a collective, never run from a decision
        return self.shm_made(group) is not None

    def all_gather(self, output, input, group, async_op):
        shm = self.shm(group)
        if shm is None:
            return super().all_gather(output, input, group, async_op)
        return self._own(
            partial(all_gather_shm, output, input, group, shm),
            partial(show_all_gather, output.numel(), output.dtype, group, async_op),
        )

    def all_gather_rows(self, rows, rank, group):
        shm = self.shm(group)
        run = (
            partial(all_gather_rows_shm, rows, group, shm)
            if shm is not None
            else partial(all_gather_p2p, rows, rank, group)
        )
        return self._own(run, partial(show_all_gather, *_gathered(rows), group, True))

    def all_gather_in_place(self, buffer, group):
        return self._own(
            partial(all_gather_by_all_reduce, buffer, group, True),
            partial(show_all_gather, buffer.numel(), buffer.dtype, group, True),
        )

    def reduce_scatter(self, output, input, group, op, async_op, *, scratch_input=False):
        show = partial(show_reduce_scatter, input.numel(), input.dtype, group, op, async_op)
        if op == dist.ReduceOp.SUM and input.is_contiguous():
            shm = self.shm(group)
            if shm is not None and shm.ring_order:
                return self._own(partial(reduce_scatter_shm, output, input, op, group, shm), show)
        if scratch_input and input.is_contiguous() and self.is_gloo(group):
            rank, world = self.place(group)
            if self.gloo_p2p and op == dist.ReduceOp.SUM and world == 2:
                return self._own(partial(reduce_scatter_pair, output, input, op, group, rank), show)
            return self._own(
                partial(reduce_scatter_in_place, output, input, op, group, True, rank, world),
                show,
            )
        return super().reduce_scatter(
            output, input, group, op, async_op, scratch_input=scratch_input
        )
