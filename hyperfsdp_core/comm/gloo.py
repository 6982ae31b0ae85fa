"""The core's transport on gloo groups: torch.distributed's collectives without gloo's
full-size buffers (:class:`GlooTransport`, the root's default on CPU).

gloo's ``all_gather_into_tensor`` gathers into a full-size buffer of its own and copies out
of it, and its ``reduce_scatter_tensor`` is a full-size clone of the input, an all-reduce of
the clone and a copy of this rank's chunk. Those buffers are allocated and freed on gloo's
worker threads, whose malloc arenas keep them resident: about a seventh of a rank's peak
RSS on the benchmark's models (docs/performance.md, "The core alone vs FSDP2"). The routes
here avoid both, with the same results bit for bit:

- all-gathers of :data:`ALL_GATHER_MIN_BYTES` and more go straight into the unit's
  unsharded buffer, point-to-point where every member is sharded on dim 0
  (:func:`all_gather_p2p`: no staging buffer and no copy-out), else as an all-reduce of
  the bit patterns (:func:`all_gather_by_all_reduce`);
- sum-reduce-scatters are point-to-point over two ranks (:func:`reduce_scatter_pair`) and
  an all-reduce in place on the engine's own pack over more (:func:`reduce_scatter_in_place`).

Smaller all-gathers, other groups (NCCL, a plugin's backend) and everything else use
torch.distributed's own collectives. ``HYPERFSDP_GLOO_NATIVE_COLLECTIVES=1`` makes gloo's
own the default again; ``HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES`` sets the size. Both are read
when a root's communication is set up (its lazy init).

What a torch dispatch mode sees is FSDP2's: a collective these routes carry is shown to an
active mode as the c10d op FSDP2 issues for it, on meta tensors of its sizes, and the
route's own calls run with the modes set aside. The route never depends on the modes: a
mode entered on one rank only must not make its collectives differ from its peers'.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from .._torch_private import modes_set_aside, show_all_gather, show_reduce_scatter, shown_to_modes
from .transport import Transport

#: ``HYPERFSDP_GLOO_NATIVE_COLLECTIVES=1`` where ``None``: gloo's own collectives by default
NATIVE: bool | None = None
#: ``HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES`` (default 1 MiB) where ``None``: all-gathers below
#: it use gloo's own (one exchange, where an all-reduce makes two; their buffer is too small
#: to matter)
ALL_GATHER_MIN_BYTES: int | None = None
#: point-to-point forms (:func:`all_gather_p2p`, :func:`reduce_scatter_pair`) where they
#: apply: plain copies (and one addition), half the bytes of an all-reduce
P2P = True


def settings() -> tuple[bool, int]:
    """``(native, all_gather_min_bytes)`` now: this module's values where set, else the
    environment's."""
    native = NATIVE
    if native is None:
        native = os.environ.get("HYPERFSDP_GLOO_NATIVE_COLLECTIVES", "") == "1"
    min_bytes = ALL_GATHER_MIN_BYTES
    if min_bytes is None:
        min_bytes = int(os.environ.get("HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES", 1 << 20))
    return native, min_bytes


def default_transport(device: torch.device) -> Transport:
    """The root's transport for collectives no unit transport takes: :class:`GlooTransport`
    on CPU (unless ``HYPERFSDP_GLOO_NATIVE_COLLECTIVES=1``), else torch.distributed's own."""
    native, min_bytes = settings()
    if device.type != "cpu" or native:
        return Transport()
    return GlooTransport(min_bytes)


# -- the routes --------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers gloo can sum (it has no 16-bit integer type)."""
    if (t.numel() * t.element_size()) % 4 == 0:
        try:
            return t.view(torch.int32)
        except RuntimeError:  # storage offset not 4-byte aligned
            pass
    return t.view(torch.uint8)


def all_gather_by_all_reduce(buffer: torch.Tensor, group, async_op: bool):
    """All-gather as an all-reduce: every rank has written its part of ``buffer`` and zeroed
    the rest. The sum runs on the bit patterns as integers, so every value, -0.0 and NaN
    payloads included, arrives exactly as sent; gloo allocates nothing of the buffer's size."""
    return dist.all_reduce(_bits(buffer), op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class Works:
    """Several works (point-to-point sends and receives) waited for as one."""

    __slots__ = ("_works",)

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self, timeout=None) -> bool:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        return True


def all_gather_p2p(rows: list[torch.Tensor], rank: int, group) -> Works:
    """All-gather by point-to-point: ``rows`` are ``(world, n)`` views of the unsharded buffer
    whose row ``rank`` this rank has written; it sends that row to every peer and receives
    each peer's row into place. Tags tell a bucket's members apart; every rank posts in the
    same order, and gloo matches a (peer, tag) pair's messages in order."""
    world = rows[0].shape[0]
    works = []
    for step in range(1, world):
        src, dst = (rank - step) % world, (rank + step) % world
        for tag, r in enumerate(rows):
            works.append(dist.irecv(r[src], group=group, group_src=src, tag=tag))
            works.append(dist.isend(r[rank], group=group, group_dst=dst, tag=tag))
    return Works(works)


class ThenAfterWait:
    """A work handle that runs ``then`` once, after the wrapped work completes (with any
    dispatch modes set aside: it is the route's own copy or addition)."""

    __slots__ = ("_then", "_work")

    def __init__(self, work, then: Callable[[], object]) -> None:
        self._work = work
        self._then = then

    def wait(self, timeout=None) -> bool:
        work, then = self._work, self._then
        if work is not None:
            self._work = self._then = None
            work.wait()
            with modes_set_aside():
                then()
        return True


#: point-to-point tag of the pair reduce-scatter (the all-gathers use member indices)
_PAIR_REDUCE_TAG = 1 << 20


def reduce_scatter_pair(output: torch.Tensor, input: torch.Tensor, group, rank: int):
    """Sum-reduce-scatter over two ranks by point-to-point: send the peer its chunk, receive
    ours into ``output`` and add our own. One addition per element, as gloo's all-reduce
    makes for two ranks (it commutes bit for bit), with half its bytes and no full-size
    buffer. ``rank`` is this rank's in ``group``."""
    peer = 1 - rank
    chunks = input.view(2, -1)
    works = [
        dist.irecv(output, group=group, group_src=peer, tag=_PAIR_REDUCE_TAG),
        dist.isend(chunks[peer], group=group, group_dst=peer, tag=_PAIR_REDUCE_TAG),
    ]
    return ThenAfterWait(Works(works), partial(output.add_, chunks[rank]))


def reduce_scatter_in_place(output, input, op, group, async_op, rank: int, world: int):
    """gloo's ``reduce_scatter_tensor`` without its clone: the same all-reduce, in place on
    ``input`` (the caller gives it up), then this rank's chunk copied to ``output``."""
    work = dist.all_reduce(input, op=op, group=group, async_op=async_op)
    chunk = input.view(world, -1)[rank]
    if work is None:
        output.copy_(chunk)
        return None
    return ThenAfterWait(work, partial(output.copy_, chunk))


def _run_shown(run: Callable, show: Callable, *shown):
    """Show the active dispatch modes ``show(*shown)`` (FSDP2's collective, on meta tensors),
    then ``run()`` the route with the modes set aside."""
    show(*shown)
    with modes_set_aside():
        return run()


class GlooTransport(Transport):
    """torch.distributed's collectives on gloo groups without gloo's full-size buffers (this
    module's routes); torch.distributed's own elsewhere. Public to plugins, to subclass
    (the hyperfsdp-shm plugin adds shared memory): :meth:`shown_all_gather` /
    :meth:`shown_reduce_scatter` run a route of a subclass's own as FSDP2's collective in
    the eyes of a dispatch mode."""

    #: the c10d backends whose groups take the routes (a subclass adds its own)
    BACKENDS: tuple[str, ...] = ("gloo",)

    def __init__(self, min_bytes: int | None = None) -> None:
        super().__init__()
        self.all_gather_min_bytes = settings()[1] if min_bytes is None else min_bytes
        self.p2p = P2P
        self._is_gloo: dict = {}  # group -> whether its backend is one of BACKENDS
        self._places: dict = {}  # group -> (this rank in it, its size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(min_bytes={self.all_gather_min_bytes})"

    @staticmethod
    def enabled() -> bool:
        """Whether a root made now gets these routes by default: false where
        ``HYPERFSDP_GLOO_NATIVE_COLLECTIVES=1`` (gloo's own collectives instead). A plugin
        that extends this transport supplies none then."""
        return not settings()[0]

    # -- per group -----------------------------------------------------------------------------
    def is_gloo(self, group) -> bool:
        known = self._is_gloo.get(group)
        if known is None:
            known = self._is_gloo[group] = dist.get_backend(group) in self.BACKENDS
        return known

    def place(self, group) -> tuple[int, int]:
        """This rank's rank in ``group`` and the group's size (looked up once)."""
        place = self._places.get(group)
        if place is None:
            place = self._places[group] = (dist.get_rank(group), dist.get_world_size(group))
        return place

    # -- what a dispatch mode sees -------------------------------------------------------------
    @staticmethod
    def shown_all_gather(run: Callable, numel: int, dtype: torch.dtype, group, async_op: bool):
        """``run()``, a route that gathers ``numel`` elements of ``dtype`` over ``group``;
        while a dispatch mode is active it is shown FSDP2's all-gather of that size first,
        and the route runs with the modes set aside."""
        if not shown_to_modes():
            return run()
        return _run_shown(run, show_all_gather, numel, dtype, group, async_op)

    @staticmethod
    def shown_rows(run: Callable, rows: list[torch.Tensor], group):
        """:meth:`shown_all_gather` for a route that gathers into ``rows`` (the ``(world, n)``
        views :meth:`all_gather_rows` is given): shown as the one all-gather FSDP2 issues for
        them (of bytes where the members' dtypes differ)."""
        if not shown_to_modes():  # the common case: nothing to size
            return run()
        if len({r.dtype for r in rows}) == 1:
            numel, dtype = sum(r.numel() for r in rows), rows[0].dtype
        else:
            numel, dtype = sum(r.numel() * r.element_size() for r in rows), torch.uint8
        return _run_shown(run, show_all_gather, numel, dtype, group, True)

    @staticmethod
    def shown_reduce_scatter(run: Callable, numel: int, dtype: torch.dtype, group, op, async_op):
        """Like :meth:`shown_all_gather`, for a reduce-scatter of ``numel`` input elements."""
        if not shown_to_modes():
            return run()
        return _run_shown(run, show_reduce_scatter, numel, dtype, group, op, async_op)

    # -- the seam ------------------------------------------------------------------------------
    def gather_route(self, group, nbytes: int, rows: bool) -> str:
        if not self.is_gloo(group) or nbytes < self.all_gather_min_bytes:
            return "native"
        return "rows" if rows and self.p2p else "in_place"

    def all_gather_rows(self, rows, rank, group):
        return self.shown_rows(partial(all_gather_p2p, rows, rank, group), rows, group)

    def all_gather_in_place(self, buffer, group):
        return self.shown_all_gather(
            partial(all_gather_by_all_reduce, buffer, group, True),
            buffer.numel(),
            buffer.dtype,
            group,
            True,
        )

    def reduce_scatter(self, output, input, group, op, async_op, *, scratch_input=False):
        if not (scratch_input and input.is_contiguous() and self.is_gloo(group)):
            return super().reduce_scatter(
                output, input, group, op, async_op, scratch_input=scratch_input
            )
        rank, world = self.place(group)
        if self.p2p and op == dist.ReduceOp.SUM and world == 2:
            run = partial(reduce_scatter_pair, output, input, group, rank)
        else:
            run = partial(reduce_scatter_in_place, output, input, op, group, True, rank, world)
        return self.shown_reduce_scatter(run, input.numel(), input.dtype, group, op, async_op)
