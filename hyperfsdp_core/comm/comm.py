"""Issuing collectives: :class:`Comm`, on CPU (async work handles) and accelerators (side
streams + events), and its counts (:class:`CommStats`).

The rest of the core calls :class:`Comm`: it issues one collective and returns a
:class:`~.handles.Handle` whose ``wait()`` makes the result usable by the caller's compute.
Which way the bytes move is a :class:`~.transport.Transport`'s choice (the communication
seam). On CPU the gloo worker threads communicate while the training thread computes (a
transport may also complete a collective when issued) and buffers are pooled
(:mod:`.pools`); on accelerators collectives run on dedicated streams ordered by events
(no ``record_stream``: buffers stay referenced by their handle until waited, and memory an
all-gather writes into is allocated under its stream and released with a wait; see
"Streams on accelerators" in docs/design.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import attrs
import torch
import torch.distributed as dist

from .._torch_private import STORAGE_MEMORY_SWAPPABLE
from .gloo import default_transport
from .handles import Handle, describe_failure
from .pools import BufferPool, StoragePool
from .records import CollectiveEvent, observed_event, wire_reports
from .transport import Transport

_broadcast = dist.broadcast


@attrs.define
class CommStats:
    """Counts of collectives issued through one :class:`Comm` (for tests and benchmarks)."""

    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_reduce_bytes: int = 0

    def reset(self) -> None:
        for field in attrs.fields(CommStats):
            setattr(self, field.name, 0)

    def snapshot(self) -> dict[str, int]:
        return attrs.asdict(self)


#: what :meth:`Comm.gather_allocation` returns on CPU (reusable, does nothing)
_NO_STREAM = contextlib.nullcontext()


class Comm:
    """Issues collectives for one root (or several roots sharing it via ``share_comm_ctx``)."""

    def __init__(
        self, device: torch.device, *, provisional: bool = False, device_module=None
    ) -> None:
        """``device_module``: run the accelerator code path on this stand-in for
        ``torch.cuda`` (its ``Stream``, ``current_stream``, events), whatever ``device``
        is: the test harness's stream simulator (``hyperfsdp_core.testing.streams``)."""
        self.device = device
        self.stats = CommStats()
        #: ``hyperfsdp_collective_observer`` callables; empty (the common case) costs one test
        self.observers: list[Callable[[CollectiveEvent], None]] = []
        #: made by ``unshard()`` before the root's first forward: replaced at lazy init
        self.provisional = provisional
        self.is_cpu = device.type == "cpu" and device_module is None
        # one pool per use: all-gather outputs and reduce-scatter inputs
        self.pools = (
            {"gather": BufferPool(device), "reduce": BufferPool(device)} if self.is_cpu else None
        )
        #: parked memory of resharded unsharded buffers (CPU, where torch can swap it)
        self.storage_pool = StoragePool() if self.is_cpu and STORAGE_MEMORY_SWAPPABLE else None
        #: what carries collectives that no unit transport (``hyperfsdp_transport``,
        #: ``set_custom_*``) takes: on CPU the gloo routes without gloo's full-size buffers
        #: (:mod:`.gloo`), else torch.distributed's own
        self.transport: Transport = default_transport(device) if self.is_cpu else Transport()
        # (unit view, its parameter group), for the collectives plugins issue through
        # ``root.comm`` with ``unit=<fqn>``; by fqn once first asked (named by then)
        self._unit_pairs: list = []
        self._unit_transports: dict[str, Transport] | None = None
        self.all_gather_stream = self.reduce_stream = None
        #: accelerators: true from the root's pre-forward (once the all-gather stream waits
        #: for the optimizer step: ``set_post_optim_event``'s event, else the whole current
        #: stream) to the end of that forward, and during the backward. Meanwhile an
        #: all-gather into memory fresh from the all-gather stream does not wait for the
        #: current stream: what it reads (the sharded parameters) is ordered by that wait,
        #: what it writes by ``release_gathered``. See "Streams on accelerators" in
        #: docs/design.md.
        self.gathers_ordered = False
        if not self.is_cpu:
            self._module = device_module or torch.get_device_module(device.type)
            self.all_gather_stream = self._module.Stream(device=device)
            self.reduce_stream = self._module.Stream(device=device)

    def order_gathers(self, ordered: bool) -> None:
        """Whether the sharded parameters are ordered after the last optimizer step, so that
        all-gathers into memory fresh from their stream need not wait for the current one
        (a root's forward and backward say so; see :meth:`all_gather`'s ``ordered``)."""
        self.gathers_ordered = ordered

    # -- buffers -------------------------------------------------------------------------

    def buffer(
        self, numel: int, dtype: torch.dtype, use: str, transport: Transport | None = None
    ) -> torch.Tensor:
        """A communication buffer for ``use`` (``"gather"`` or ``"reduce"``).

        The ``allocate`` of ``transport``'s comm object for ``use`` decides where it lives
        if it has one (FSDP2-style custom comms); otherwise a pooled buffer (CPU).
        """
        custom = transport.allocator(use) if transport is not None else None
        if custom is None and self.pools is not None:
            if use == "reduce" and self.storage_pool is not None:
                # the memory a unit's reshard just parked, if of this size
                storage = self.storage_pool.take(numel * dtype.itemsize)
                if storage is not None:
                    return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))
            return self.pools[use].get(numel, dtype)
        with self.gather_allocation() if use == "gather" else _NO_STREAM:
            if custom is not None:
                return custom.allocate((numel,), dtype=dtype, device=self.device)
            return torch.empty(numel, dtype=dtype, device=self.device)

    def gather_allocation(self):
        """Where memory that an all-gather writes into is allocated: on accelerators under
        the all-gather stream, so the caching allocator hands a freed block only to later
        work of that stream (ordered by :meth:`release_gathered`); nothing to do on CPU."""
        if self.all_gather_stream is None:
            return _NO_STREAM
        return self._module.stream(self.all_gather_stream)

    def release_gathered(self) -> None:
        """Memory allocated by :meth:`gather_allocation` is about to be freed: the
        all-gather stream's later work (which may reuse it) waits for everything the
        current stream has queued so far (which may still read it). Nothing on CPU."""
        if self.all_gather_stream is not None:
            self.all_gather_stream.wait_stream(self._module.current_stream())

    def recycle(
        self, tensor: torch.Tensor | None, use: str, transport: Transport | None = None
    ) -> None:
        """``tensor`` (from :meth:`buffer`) is no longer used by the caller's stream: pooled
        on CPU (unless ``transport`` allocated it); on accelerators a gather buffer's
        stream is ordered for its reuse (the caller drops the tensor after this)."""
        custom = transport.allocator(use) if transport is not None else None
        if use == "gather":
            self.release_gathered()
        if self.pools is not None and tensor is not None and custom is None:
            parking = use == "reduce" and self.storage_pool is not None
            if parking and self.storage_pool.parks(tensor.untyped_storage()):
                return  # parked for the next unshard of that size (see ``buffer``)
            self.pools[use].put(tensor)

    def trim(self) -> None:
        """Free every idle pooled buffer."""
        if self.pools is not None:
            for pool in self.pools.values():
                pool.clear()
        if self.storage_pool is not None:
            self.storage_pool.clear()

    def stop_parking(self) -> None:
        """This pass issues no further unshard: resharded memory is freed, not parked."""
        if self.storage_pool is not None:
            self.storage_pool.stop()

    def resume_parking(self, max_idle: int = 2) -> None:
        """Reshards park their memory again, at most ``max_idle`` buffers at a time."""
        if self.storage_pool is not None:
            self.storage_pool.resume(max_idle)

    @property
    def pooled_bytes(self) -> int:
        if self.pools is None:
            return 0
        parked = self.storage_pool.nbytes if self.storage_pool is not None else 0
        return sum(p.nbytes for p in self.pools.values()) + parked

    # -- collectives ---------------------------------------------------------------------
    # ``transport`` is the unit's (``hyperfsdp_transport``, ``set_custom_*``), or None: the
    # root's default (:attr:`transport`). The transport picks the route; the module-level
    # ``_all_gather`` etc. of :mod:`.transport` are looked up at call time. ``unit`` names
    # the unit for observers; ``prepare`` (all-gathers) runs on the communication stream
    # right before the collective (the copy-in of the input).
    def all_gather(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        group,
        transport: Transport | None = None,
        *,
        unit=None,
        prepare=None,
        ordered: bool = False,
    ) -> Handle:
        """``ordered`` (accelerators): ``inp`` needs no ordering beyond the root's
        (:attr:`gathers_ordered`) and ``out`` is fresh from :meth:`gather_allocation`, so
        the all-gather does not wait for the current stream."""
        self._count_gather(out, group, unit)
        t = self._route(transport)
        call = lambda: t.all_gather(out, inp, group, self.is_cpu)  # noqa: E731
        wait = not (ordered and self.gathers_ordered)
        return self._issue(
            self.all_gather_stream,
            call,
            (out, inp),
            prepare,
            wait,
            ("all_gather", unit, out, group),
        )

    def all_gather_in_place(
        self, buffer: torch.Tensor, group, transport: Transport | None = None, *, unit=None, prepare
    ) -> Handle:
        """All-gather into ``buffer`` in its own layout (route ``"in_place"``): ``prepare``
        writes this rank's parts and zeroes the rest."""
        self._count_gather(buffer, group, unit)
        t = self._route(transport)
        call = lambda: t.all_gather_in_place(buffer, group)  # noqa: E731
        return self._issue(None, call, (buffer,), prepare, what=("all_gather", unit, buffer, group))

    def all_gather_rows(
        self,
        buffer: torch.Tensor,
        rows: list[torch.Tensor],
        rank: int,
        group,
        transport: Transport | None = None,
        *,
        unit,
        prepare,
    ) -> Handle:
        """All-gather into ``buffer`` row by row (route ``"rows"``, all members on dim 0):
        ``prepare`` writes this rank's row of every ``rows`` view, then each row goes to
        every peer."""
        self._count_gather(buffer, group, unit)
        t = self._route(transport)
        call = lambda: t.all_gather_rows(rows, rank, group)  # noqa: E731
        return self._issue(None, call, (buffer,), prepare, what=("all_gather", unit, buffer, group))

    def add_unit_transports(self, pairs: list) -> None:
        """``(unit view, its parameter group)`` pairs of a root's units: the group's
        ``plugin_transport`` (``hyperfsdp_transport``) carries what plugins issue for it."""
        self._unit_pairs = self._unit_pairs + [p for p in pairs if p not in self._unit_pairs]
        self._unit_transports = None

    def unit_transport(self, unit: str | None) -> Transport | None:
        """The plugin transport of the unit named ``unit`` (its fqn), or None."""
        if unit is None or not self._unit_pairs:
            return None
        if self._unit_transports is None:
            self._unit_transports = {
                view.fqn: group.plugin_transport
                for view, group in self._unit_pairs
                if group.plugin_transport is not None
            }
        return self._unit_transports.get(unit)

    def _count_gather(self, buffer: torch.Tensor, group, unit) -> None:
        self.stats.all_gathers += 1
        self.stats.all_gather_bytes += buffer.numel() * buffer.element_size()

    def _route(self, transport: Transport | None) -> Transport:
        """The transport a collective runs on: the unit's, else the root's default."""
        return self.transport if transport is None else transport

    def gather_route_of(self, transport: Transport | None, group, nbytes: int, rows: bool) -> str:
        """The route of an all-gather whose input is the sharded storage itself (see
        :meth:`Transport.gather_route`)."""
        return self._route(transport).gather_route(group, nbytes, rows)

    def gathers_in_line(self, transport: Transport | None, group) -> bool:
        """Whether an all-gather over ``group`` completes when issued (CPU only)."""
        return self.is_cpu and self._route(transport).gathers_in_line(group)

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        group,
        op,
        transport: Transport | None = None,
        *,
        unit=None,
        scratch_input: bool = False,
    ) -> Handle:
        """Reduce-scatter ``inp`` into ``out``. ``scratch_input``: the caller gives ``inp``
        up (it may be overwritten): a transport may reduce in place on it."""
        self.stats.reduce_scatters += 1
        self.stats.reduce_scatter_bytes += inp.numel() * inp.element_size()
        t = self._route(transport)
        call = lambda: t.reduce_scatter(  # noqa: E731
            out, inp, group, op, self.is_cpu, scratch_input=scratch_input
        )
        what = ("reduce_scatter", unit, inp, group)
        return self._issue(self.reduce_stream, call, (out, inp), what=what)

    def all_reduce(
        self, tensor: torch.Tensor, group, op, transport: Transport | None = None, *, unit=None
    ) -> Handle:
        self.stats.all_reduces += 1
        self.stats.all_reduce_bytes += tensor.numel() * tensor.element_size()
        t = self._route(transport)
        call = lambda: t.all_reduce(tensor, group, op, self.is_cpu)  # noqa: E731
        return self._issue(
            self.reduce_stream, call, (tensor,), what=("all_reduce", unit, tensor, group)
        )

    def broadcast(self, tensor: torch.Tensor, src: int, group, *, unit=None) -> Handle:
        call = lambda: _broadcast(tensor, group_src=src, group=group, async_op=self.is_cpu)  # noqa: E731
        return self._issue(
            self.reduce_stream, call, (tensor,), what=("broadcast", unit, tensor, group)
        )

    def _observed(self, call, what):
        """Run ``call`` (a transport's collective) and tell the observers what it issued,
        with what the transport reported putting on the wire (:func:`report_wire`)."""
        with wire_reports() as reported:
            work = call()
        event = observed_event(what, dist.get_world_size(what[3]), reported)
        for observer in self.observers:
            observer(event)
        return work

    def _issue(self, stream, call, keepalive, prepare=None, wait: bool = True, what=None) -> Handle:
        """Run one collective: async on CPU (a work handle, or none if it finished in
        place), on ``stream`` on accelerators, ordered after the work queued on the
        current stream unless ``wait`` is false. ``what`` (kind, unit, tensor, group)
        names the collective in the note a failure gets (:func:`describe_failure`) and in
        the observers' event. On accelerators a transport is called with ``async_op=False``
        on ``stream``; a work object it returns anyway is waited for there and then."""
        if self.observers:
            call = partial(self._observed, call, what)
        try:
            if self.is_cpu:
                if prepare is not None:
                    prepare()
                work = call()
                if work is None:
                    return Handle()
                return Handle(work, keepalive=keepalive, what=what)
            if wait:
                stream.wait_stream(self._module.current_stream())
            with self._module.stream(stream):
                if prepare is not None:
                    prepare()
                work = call()
                if work is not None:
                    work.wait()
                event = stream.record_event()
        except Exception as e:
            describe_failure(e, what)
            raise
        return Handle(event=event, keepalive=keepalive, module=self._module, what=what)

    def current_stream(self):
        return self._module.current_stream()
