"""Collectives on CPU (async work handles) and accelerators (side streams + events).

The rest of the core calls :class:`Comm`: it issues one collective and returns a
:class:`Handle` whose ``wait()`` makes the result usable by the caller's compute.
Which way the bytes move is a :class:`Transport`'s choice (the communication seam): a
unit's own (a plugin's ``hyperfsdp_transport``, FSDP2's ``set_custom_*`` comm objects),
else the root's default: torch.distributed's own collectives (the ``hyperfsdp-shm``
plugin supplies shared memory and gloo stand-ins on CPU through the same seam). On CPU
the gloo worker threads communicate while the training thread computes (a transport may
also complete a collective when issued); on accelerators collectives run on dedicated
streams ordered by events (no ``record_stream``: buffers stay referenced by their
handle until waited, and memory an all-gather writes into is allocated under its stream
and released with a wait; see "Streams on accelerators" in docs/design.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist

from .records import CollectiveEvent

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_reduce = dist.all_reduce
_broadcast = dist.broadcast


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


_NOTE = "hyperfsdp: the "


def describe_failure(error: BaseException, what) -> None:
    """Add a note to ``error`` naming the failed collective: its kind, the unit (FQN), the
    bytes and the group's ranks (the exception's type and message stay torch's or the
    transport's; the note shows in its traceback and in ``error.__notes__``)."""
    if what is None or any(n.startswith(_NOTE) for n in getattr(error, "__notes__", ())):
        return
    kind, unit, tensor, group = what
    try:
        ranks = dist.get_process_group_ranks(group) if group is not None else "default group"
    except Exception:  # the group may be gone by now
        ranks = "unknown"
    nbytes = tensor.numel() * tensor.element_size()
    error.add_note(
        f"{_NOTE}{kind} of unit {unit or '<root>'!r} ({nbytes} bytes of "
        f"{tensor.dtype}, ranks {ranks}) failed; if a peer died or stopped, its own log "
        "says why"
    )


class Handle:
    """A pending collective. ``wait()`` is idempotent.

    On CPU it wraps a work handle (``wait()`` blocks until gloo is done); on an
    accelerator an event recorded on the communication stream (``wait()`` makes the
    current stream wait for it, without blocking the host).
    """

    __slots__ = ("_done", "_event", "_module", "_what", "_work", "keepalive")

    def __init__(self, work=None, event=None, keepalive=None, module=None, what=None) -> None:
        self._work = work
        self._event = event
        self._module = module
        self._done = work is None and event is None
        self.keepalive = keepalive
        self._what = what  # (kind, unit, tensor, group), for a failure's note

    @property
    def done(self) -> bool:
        """Whether the collective has completed (it ran in line) or been waited for."""
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            try:
                self._work.wait()
            except Exception as e:
                describe_failure(e, self._what)
                raise
        if self._event is not None:
            self._module.current_stream().wait_event(self._event)
        self._done = True
        self._work = self._event = None
        self.keepalive = None

    def abandon(self) -> None:
        """Wait, ignoring errors (used when recovering from a failed iteration)."""
        try:
            self.wait()
        except Exception:
            self._done = True
            self._work = self._event = self.keepalive = None


class Ready(Handle):
    """A handle that is always complete (local paths that issue no collective)."""

    def wait(self) -> None:
        return

    def abandon(self) -> None:
        return


#: The handle of work that is already complete.
READY = Ready()


class BufferPool:
    """Reuses communication buffers instead of reallocating them every time (CPU only).

    Keeps idle buffers of one size class (numel, dtype) per use: a run of units of the
    same size (transformer blocks) passes the same buffers along, and a buffer of
    another size (the root's) is freed as soon as a different size is asked for, so it
    does not sit idle through the rest of the pass. Accelerators' caching allocators
    already reuse memory, so they get no pool.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._key: tuple[int, torch.dtype] | None = None
        self._free: list[torch.Tensor] = []

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (numel, dtype)
        if key != self._key:
            self._key = key
            self._free = []
        if self._free:
            return self._free.pop()
        return torch.empty(numel, dtype=dtype, device=self.device)

    def put(self, tensor: torch.Tensor) -> None:
        if (tensor.numel(), tensor.dtype) == self._key:
            self._free.append(tensor)

    def clear(self) -> None:
        self._free = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._free)


class StoragePool:
    """Memory of resharded unsharded buffers, handed back at the next unshard (CPU only).

    Reshard parks a buffer's memory here instead of freeing it (the buffer's storage is
    then empty, as after ``resize_(0)``); an unshard of the same byte size takes it back
    instead of faulting in fresh pages from the OS. Like :class:`BufferPool`: one size
    class at a time and at most ``max_idle`` parked buffers, emptied with the other
    pools at the end of every forward and backward. Parking changes where the pages come
    from, not how many are in use, as long as the memory is taken back at once:

    - in forward a unit reshards just before the next unit's unshard (its prefetch, or
      its own pre-forward where gathers run in line), which takes the memory; once the
      forward has no unshard left to issue, :meth:`stop` frees what is parked and
      reshards free until :meth:`resume`;
    - in backward (at most one buffer) a unit's reshard parks, its reduce-scatter input
      of the same size takes the memory (:meth:`take`), and once the reduce-scatter is
      done the input is parked again (:meth:`parks`) for the next unit's unshard, one
      buffer handed along the backward. A backward prefetch of a unit not yet unsharded
      is issued before the unit after it reshards, so it stops parking: parked memory
      would idle through a whole gradient computation.
    """

    def __init__(self, max_idle: int = 2) -> None:
        self.max_idle = max_idle
        self.parking = True
        self._key: int | None = None
        self._free: list[torch.UntypedStorage] = []

    def stop(self) -> None:
        """No unshard will take parked memory in this pass: free it, and free from now on."""
        self.parking = False
        self._free = []

    def resume(self, max_idle: int = 2) -> None:
        self.parking = True
        self.max_idle = max_idle

    def parks(self, storage: torch.UntypedStorage) -> bool:
        """Park ``storage``'s memory if it is of the size class parked now (a reduce-scatter
        input of a unit's unsharded size, done with: the next unit's unshard takes it)."""
        if not self.parking or storage.nbytes() != self._key:
            return False
        self.park(storage)
        return True

    def park(self, storage: torch.UntypedStorage) -> None:
        from .._torch_private import swap_storage_memory

        if not self.parking:
            storage.resize_(0)
            return
        nbytes = storage.nbytes()
        if nbytes != self._key:
            self._key = nbytes
            self._free = []
        if len(self._free) >= self.max_idle:
            storage.resize_(0)
            return
        holder = torch.UntypedStorage(0)
        swap_storage_memory(holder, storage)
        self._free.append(holder)

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        """Parked memory of ``nbytes`` as a storage of its own, or None if none is idle."""
        if nbytes != self._key or not self._free:
            return None
        return self._free.pop()

    def unpark(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give ``storage`` (empty) parked memory of ``nbytes``; False if none is idle."""
        if nbytes != self._key or not self._free:
            return False
        from .._torch_private import swap_storage_memory

        swap_storage_memory(storage, self._free.pop())
        return True

    def clear(self) -> None:
        self._free = []

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._free)


class Comm:
    """Issues collectives for one root (or several roots sharing it via ``share_comm_ctx``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stats = CommStats()
        #: ``hyperfsdp_collective_observer`` callables; empty (the common case) costs one test
        self.observers: list[Callable[[CollectiveEvent], None]] = []
        #: made by ``unshard()`` before the root's first forward: replaced at lazy init
        self.provisional = False
        self.is_cpu = device.type == "cpu"
        # one pool per use: all-gather outputs and reduce-scatter inputs
        self.pools = (
            {"gather": BufferPool(device), "reduce": BufferPool(device)} if self.is_cpu else None
        )
        #: parked memory of resharded unsharded buffers (CPU)
        self.storage_pool = StoragePool() if self.is_cpu else None
        #: what carries collectives that no unit transport (``hyperfsdp_transport``,
        #: ``set_custom_*``) takes: torch.distributed's own
        self.transport: Transport = Transport()
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
            self._module = torch.get_device_module(device.type)
            self.all_gather_stream = self._module.Stream(device=device)
            self.reduce_stream = self._module.Stream(device=device)

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
            if use == "reduce":  # the memory a unit's reshard just parked, if of this size
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
            if use == "reduce" and self.storage_pool.parks(tensor.untyped_storage()):
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
    # ``_all_gather`` etc. are looked up at call time (tests count them). ``unit`` names
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
        if self.observers:
            self._observe("all_gather", group, buffer, unit)

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
        if self.observers:
            self._observe("reduce_scatter", group, inp, unit)
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
        if self.observers:
            self._observe("all_reduce", group, tensor, unit)
        t = self._route(transport)
        call = lambda: t.all_reduce(tensor, group, op, self.is_cpu)  # noqa: E731
        return self._issue(
            self.reduce_stream, call, (tensor,), what=("all_reduce", unit, tensor, group)
        )

    def broadcast(self, tensor: torch.Tensor, src: int, group, *, unit=None) -> Handle:
        if self.observers:
            self._observe("broadcast", group, tensor, unit)
        call = lambda: _broadcast(tensor, group_src=src, group=group, async_op=self.is_cpu)  # noqa: E731
        return self._issue(
            self.reduce_stream, call, (tensor,), what=("broadcast", unit, tensor, group)
        )

    def _observe(self, kind: str, group, tensor: torch.Tensor, unit) -> None:
        event = CollectiveEvent(
            kind,
            dist.get_world_size(group),
            tensor.numel() * tensor.element_size(),
            tensor.dtype,
            unit,
        )
        for observer in self.observers:
            observer(event)

    def _issue(self, stream, call, keepalive, prepare=None, wait: bool = True, what=None) -> Handle:
        """Run one collective: async on CPU (a work handle, or none if it finished in
        place), on ``stream`` on accelerators, ordered after the work queued on the
        current stream unless ``wait`` is false. ``what`` (kind, unit, tensor, group)
        names the collective in the note a failure gets (:func:`describe_failure`)."""
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
                call()
                event = stream.record_event()
        except Exception as e:
            describe_failure(e, what)
            raise
        return Handle(event=event, keepalive=keepalive, module=self._module, what=what)

    def current_stream(self):
        return self._module.current_stream()


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
