"""A simulated accelerator for checking the core's stream and event ordering on CPU.

``simulated_accelerator()`` makes every ``Comm`` created inside it take the accelerator
code path -- communication streams, events, collectives issued synchronously on gloo --
with streams that only keep order: each stream carries a vector clock, ``record_event``
captures it, ``wait_event`` / ``wait_stream`` merge it. Every operation (through a
``TorchDispatchMode``) is enqueued on the stream current when it runs, and the simulator
checks, as it happens, the two hazards a missing wait causes on a real device:

- **read after write**: an operation on one stream reads memory that another stream
  wrote, without being ordered after that write (e.g. an all-gather reading sharded
  parameters before the optimizer step that updated them);
- **reuse of memory**: an operation writes into memory whose block the caching allocator
  could have handed over while another stream still used it. As CUDA's caching allocator
  does (without ``record_stream``), a block allocated under a stream is reused only by
  later allocations under that stream: memory allocated under stream A and written by
  stream B needs B ordered after A at the allocation, and memory allocated under B and
  used by A needs B ordered after A when it is freed.

Each violation is appended to ``sim.violations`` as a line of text. Tests train under
it and assert there are none; a test that removes a wait asserts there are some.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections import deque
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from .._torch_private import TorchDispatchMode, dtensor_local_tensor, tree_flatten

__all__ = ["SimEvent", "SimStream", "Simulator", "simulated_accelerator"]


class SimEvent:
    """A recorded point of a stream: the vector clock it captured."""

    __slots__ = ("clock",)

    def __init__(self, clock: dict | None = None) -> None:
        self.clock = dict(clock or {})

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Simulated work is done when it is enqueued: nothing to wait for."""


class SimStream:
    """A stream that keeps order only: its vector clock counts what it has enqueued and
    what of other streams it waits for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.clock: dict[SimStream, int] = {self: 0}

    def enqueue(self) -> dict:
        """One operation enqueued: its clock."""
        self.clock[self] += 1
        return dict(self.clock)

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        clock = self.enqueue()
        if event is None:
            return SimEvent(clock)
        event.clock = clock
        return event

    def wait_event(self, event: SimEvent) -> None:
        for stream, n in event.clock.items():
            if self.clock.get(stream, 0) < n:
                self.clock[stream] = n

    def wait_stream(self, other: SimStream) -> None:
        self.wait_event(other.record_event())

    def after(self, clock: dict, stream: SimStream) -> bool:
        """Whether this stream's next operation is ordered after ``stream``'s operation
        with ``clock``."""
        return stream is self or self.clock.get(stream, 0) >= clock[stream]

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Simulated work is done when it is enqueued: nothing to wait for."""

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The address range ``t``'s elements occupy (None: no memory)."""
    if isinstance(t, DTensor):  # its shard
        t = dtensor_local_tensor(t)
    if t.device.type == "meta" or t.numel() == 0:
        return None
    try:
        start = t.data_ptr()
    except RuntimeError:  # a wrapper subclass without storage
        return None
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    return start, start + extent * t.element_size()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _forget(span: tuple[int, int], *tables: dict, recorded_by: int | None = None) -> None:
    """Drop the entries (keyed by start address, ``end`` first in the value) of ``tables``
    that overlap ``span``; with ``recorded_by``, only the writes recorded by then (record
    number last in the value)."""
    for table in tables:
        for start in [
            s
            for s, entry in table.items()
            if _overlaps(span, (s, entry[0])) and (recorded_by is None or entry[-1] <= recorded_by)
        ]:
            del table[start]


class Simulator(TorchDispatchMode):
    """The simulated device: what ``torch.get_device_module`` would return (``Stream``,
    ``current_stream``, ``stream``), and the checks (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.default = SimStream("current")
        self._current = self.default
        self.streams: list[SimStream] = [self.default]
        self.violations: list[str] = []
        self.ops = 0
        #: (op index, collective, stream name, clock) of every collective, in issue order
        self.collectives: list[tuple[int, str, str, dict]] = []
        # last writes, by start address: (end, stream, clock, what, record number); the default
        # stream's are checked against reads on side streams only, side streams' against
        # every read
        self._default_writes: dict[int, tuple[int, SimStream, dict, str, int]] = {}
        self._side_writes: dict[int, tuple[int, SimStream, dict, str, int]] = {}
        # live allocations under the default stream: start -> (end, clock)
        self._default_allocs: dict[int, tuple[int, dict]] = {}
        # live allocations under side streams: start -> (end, owner, {stream: last use})
        self._side_allocs: dict[int, tuple[int, SimStream, dict]] = {}
        self._records = 0  # writes recorded so far: what came before a free, what after
        # side streams' outputs whose memory was freed, as (span, record number then):
        # appended by finalizers on whichever thread frees them, handled by the next op
        self._freed_outputs: deque[tuple[tuple[int, int], int]] = deque()

    # -- the device module surface ---------------------------------------------------------
    def Stream(self, device=None, priority: int = 0) -> SimStream:
        stream = SimStream(f"side{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def Event(self, *args, **kwargs) -> SimEvent:
        return SimEvent()

    def current_stream(self, device=None) -> SimStream:
        return self._current

    @contextlib.contextmanager
    def stream(self, stream: SimStream) -> Iterator[None]:
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    def synchronize(self, device=None) -> None:
        """Simulated work is done when it is enqueued: nothing to wait for."""

    # -- checks -----------------------------------------------------------------------------
    def _violation(self, text: str) -> None:
        self.violations.append(text)

    def _use(self, span: tuple[int, int], stream: SimStream, clock: dict) -> None:
        """Side-stream allocations remember each other stream's last use."""
        for start, (end, owner, uses) in self._side_allocs.items():
            if owner is not stream and _overlaps(span, (start, end)):
                uses[stream] = clock

    def _read(self, span: tuple[int, int], stream: SimStream, clock: dict, what: str) -> None:
        tables = (self._side_writes,)
        if stream is not self.default:
            tables = (self._side_writes, self._default_writes)
        for table in tables:
            for start, (end, writer, at, wrote, _) in table.items():
                if _overlaps(span, (start, end)) and not stream.after(at, writer):
                    self._violation(
                        f"{what} on {stream.name} reads memory that {wrote} on "
                        f"{writer.name} wrote, without waiting for it"
                    )
        self._use(span, stream, clock)

    def _write(self, span: tuple[int, int], stream: SimStream, clock: dict, what: str) -> None:
        if stream is not self.default:
            for start, (end, at) in self._default_allocs.items():
                if _overlaps(span, (start, end)) and not stream.after(at, self.default):
                    self._violation(
                        f"{what} on {stream.name} writes memory allocated under "
                        f"{self.default.name} without waiting for it as of the allocation"
                    )
            for start, (end, writer, at, wrote, _) in self._default_writes.items():
                if _overlaps(span, (start, end)) and not stream.after(at, writer):
                    self._violation(
                        f"{what} on {stream.name} overwrites memory that {wrote} on "
                        f"{writer.name} wrote, without waiting for it"
                    )
        table = self._default_writes if stream is self.default else self._side_writes
        self._records += 1
        table[span[0]] = (span[1], stream, clock, what, self._records)
        self._use(span, stream, clock)

    def allocated(self, span: tuple[int, int], owner: object = None) -> None:
        """Fresh memory under the current stream (``owner``: the tensor whose death frees
        it; None: freed by ``resize_(0)``)."""
        stream = self._current
        # fresh memory: no writer to wait for; an allocation we saw there was freed
        _forget(span, self._default_writes, self._side_writes)
        _forget(span, self._default_allocs, self._side_allocs)
        if stream is self.default:
            self._default_allocs[span[0]] = (span[1], dict(stream.clock))
            return
        self._side_allocs[span[0]] = (span[1], stream, {})
        if owner is not None:
            weakref.finalize(owner, self.freed, span[0])

    def _fresh(
        self, t: torch.Tensor, span: tuple[int, int], stream: SimStream, clock: dict, what: str
    ) -> None:
        """An operation's output ``t`` in memory it allocated itself. On CPU the host
        allocator hands addresses across streams, so what is recorded about earlier memory
        there is dropped; a side stream's output is a write the other streams must wait
        for, until its memory is freed. Freed, the host allocator may hand the address to
        memory allocated where the simulator does not see it (a collective's own buffers:
        gloo's ``reduce_scatter_tensor`` on torch 2.11 copies out of one at ``wait()``), and
        a read there is not a read of that write; on a device the block would go back to
        the side stream's pool."""
        tables: tuple[dict, ...] = (self._side_writes, self._side_allocs)
        if stream is not self.default:
            tables += (self._default_writes, self._default_allocs)
        _forget(span, *tables)
        if stream is not self.default:
            self._records += 1
            self._side_writes[span[0]] = (span[1], stream, clock, what, self._records)
            # ``span`` is not None: ``t`` (a DTensor's shard) has storage
            local = dtensor_local_tensor(t) if isinstance(t, DTensor) else t
            weakref.finalize(local.untyped_storage(), self._output_freed, span)

    def _output_freed(self, span: tuple[int, int]) -> None:
        self._freed_outputs.append((span, self._records))  # any thread

    def _forget_freed_outputs(self) -> None:
        """Drop the writes into side streams' outputs freed since the last operation:
        those recorded while the memory was theirs (by record number), not newer ones."""
        freed = self._freed_outputs
        while freed:
            span, at = freed.popleft()
            _forget(span, self._side_writes, self._default_writes, recorded_by=at)

    def freed(self, start: int) -> None:
        default = self._default_allocs.pop(start, None)
        entry = self._side_allocs.pop(start, None)
        end = entry[0] if entry is not None else default[0] if default is not None else None
        if end is not None:  # what it held is dead: nobody waits for those writes now
            _forget((start, end), self._default_writes, self._side_writes)
        if entry is None:
            return
        _, owner, uses = entry
        # the block goes back to ``owner``'s pool: its later work must come after every
        # other stream's use of it
        for stream, clock in uses.items():
            if not owner.after(clock, stream):
                self._violation(
                    f"memory allocated under {owner.name} is freed while {stream.name} may "
                    f"still use it ({owner.name} does not wait for {stream.name})"
                )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._freed_outputs:
            self._forget_freed_outputs()
        stream = self._current
        clock = stream.enqueue()
        self.ops += 1
        name = str(func)
        written = []
        if name.startswith("c10d."):  # in-place collectives: the first argument(s) written
            self.collectives.append((self.ops, name, stream.name, clock))
            first = args[0]
            written = list(first) if isinstance(first, (list, tuple)) else [first]
            reads = [a for a in tree_flatten(args[1:])[0] if isinstance(a, torch.Tensor)]
        else:
            reads = []
            for i, arg in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
                if arg.alias_info is not None and arg.alias_info.is_write:
                    written += tensors
                else:
                    reads += tensors
        for t in reads:
            span = _span(t)
            if span is not None:
                self._read(span, stream, clock, name)
        out = func(*args, **kwargs)
        if name.startswith(("aten.empty.", "aten.empty_strided.", "aten.empty_like.")):
            span = _span(out)
            if span is not None:
                self.allocated(span, out)
        elif not name.startswith("c10d."):
            returns = func._schema.returns
            if not returns:
                outs = []
            elif len(returns) == 1:  # one tensor, or one list of them
                outs = [(returns[0], t) for t in tree_flatten(out)[0]]
            else:
                outs = list(zip(returns, out))
            for ret, t in outs:
                if ret.alias_info is None and isinstance(t, torch.Tensor):
                    span = _span(t)
                    if span is not None:
                        self._fresh(t, span, stream, clock, name)
        for t in written:
            span = _span(t)
            if span is not None:
                self._write(span, stream, clock, name)
        return out


@contextlib.contextmanager
def simulated_accelerator() -> Iterator[Simulator]:
    """Every ``Comm`` made in the block runs the accelerator code path on the simulator;
    storage resizes and ``torch.empty`` are tracked as allocations (see module docstring).
    Yields the simulator (``sim.violations``: what went wrong)."""
    from ..comm import Comm

    sim = Simulator()
    comm_init = Comm.__init__
    resize = torch.UntypedStorage.resize_

    def init(comm, device, **kwargs):
        comm_init(comm, device, **kwargs, device_module=sim)
        comm.all_gather_stream.name = "all_gather"
        comm.reduce_stream.name = "reduce"

    def tracked_resize(storage, nbytes):
        if storage.size() and nbytes == 0:
            sim.freed(storage.data_ptr())
        out = resize(storage, nbytes)
        if nbytes:
            start = storage.data_ptr()
            sim.allocated((start, start + nbytes))
            # a storage's memory is freed by ``resize_(0)`` (tracked) or with the storage
        return out

    Comm.__init__ = init
    torch.UntypedStorage.resize_ = tracked_resize
    # torch.distributed's own collectives, as on an accelerator: neither the core's gloo
    # routes nor a CPU transport plugin (both read this at each root's lazy init)
    saved_env = os.environ.get(_NATIVE_ENV)
    os.environ[_NATIVE_ENV] = "1"
    try:
        with sim:
            yield sim
    finally:
        Comm.__init__ = comm_init
        torch.UntypedStorage.resize_ = resize
        _restore_env(_NATIVE_ENV, saved_env)


#: while this is "1", gloo's own collectives: no core gloo routes, no hyperfsdp-shm transport
_NATIVE_ENV = "HYPERFSDP_GLOO_NATIVE_COLLECTIVES"


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
