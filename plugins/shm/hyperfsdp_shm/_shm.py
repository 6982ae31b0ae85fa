"""All-gathers and reduce-scatters through shared memory, for the ranks of one host.

gloo moves every byte through a loopback TCP socket: a copy into the kernel, a copy out,
and a worker-thread handoff per message, which on CPU ranks costs more than the compute
it overlaps (docs/performance.md). Ranks on one host can instead copy straight out of
each other's memory. Each member of a group maps a small segment of every member
(``/dev/shm``): a header of counters and :data:`SLOTS` slots of :data:`CHUNK_BYTES`. A
collective streams each rank's payload through its own slots, a chunk at a time, and
every peer copies (or adds) it into place: one copy in, one copy out, no kernel call.

Every member runs every collective of the group in the same order (as with any
collective), synchronously, in lockstep:

- a rank writes its chunk ``c`` into slot ``c % SLOTS`` once every peer has consumed its
  chunk ``c - SLOTS`` from that slot, then publishes ``c`` (its ``PUB`` counter);
- a rank consumes peer ``p``'s chunk ``c`` once ``p`` has published it, then
  acknowledges it (its ``ACK + p`` counter).

Each counter has one writer, so no atomic read-modify-write is needed; stores of the
data and then of the counter are seen in that order by the other processes on x86-64
(total store order), which is why the transport is used there only. Every chunk carries
a tag of the collective (its sequence number, kind and size): a member that runs a
different collective fails with an error naming both instead of reading wrong data.
Waits time out with the group's timeout, and fail at once when a peer process exits.

The collectives are exact: all-gathers copy bytes; a reduce-scatter over two ranks is one
addition per element (which commutes bit for bit, as gloo's own sum over two), and over
more ranks adds in the order gloo's ring all-reduce does (``ring_owner_runs``; checked
against gloo on each group before it is used, else gloo keeps those reduce-scatters).
A group uses the transport only when every member could create and map every member's
segment, which the members decide together when the group is first used
(:meth:`ShmGroup.create`); otherwise the core keeps gloo.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import platform
import secrets
import socket
import sys
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from ._settings import shm_dir

#: bytes per slot: a collective moves its payload in chunks of this size (figures:
#: docs/performance.md; 256 KiB to 4 MiB measured the same)
CHUNK_BYTES = 1 << 20
#: slots per member: a rank writes its next chunk while its peers read the previous one
SLOTS = 2

# header layout, in int64 words: published chunks, the tag of each slot's chunk, this
# rank's acknowledgement of each member's chunks, and the token peers check when mapping
_PUB = 0
_TAG = 8  # _TAG + slot
_TOKEN = 16
_POISON = 17  # nonzero once this member's transport failed (its peers then fail at once)
_WAITING = 18  # nonzero while this member blocks on a peer's counter (the peer then wakes it)
_ACK = 64  # _ACK + member

#: seconds of waiting between checks that the peers' processes are still alive
_LIVENESS_EVERY = 1.0
#: how a rank waits for a peer: it polls the peer's counter for up to ``_SPIN_S`` seconds
#: (on a quiet machine the peer is a few microseconds behind), then blocks in the kernel
#: (a futex on the counter's word, which the peer wakes when it stores the counter and
#: sees this rank's ``_WAITING`` flag), each block bounded by a timeout from
#: ``_FIRST_PAUSE_S`` doubling up to ``_MAX_PAUSE_S`` (a safety net; without futexes,
#: plain sleeps of those lengths). Its core goes to the peer or to whatever else runs on
#: the host meanwhile. It never ``sched_yield``s: under load that hands the core to a busy
#: process for a whole time slice per call (milliseconds).
_SPIN_S = 50e-6
_FIRST_PAUSE_S = 100e-6
_MAX_PAUSE_S = 2e-3
#: x86-64 Linux ``futex(2)``: its syscall number and operations (shared, not private:
#: the word is in memory other processes map)
_SYS_FUTEX = 202
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


def _load_syscall():
    """libc's ``syscall``, or None where it cannot be loaded (then waits sleep)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


_syscall = _load_syscall() if sys.platform.startswith("linux") else None


def _as_int32(value: int) -> int:
    """The low 32 bits of a counter (the futex word on little-endian x86-64), signed."""
    return ((value & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


#: chunk plans kept per group (one per bucket that gathers row by row)
_MAX_PLANS = 1024


class ShmCollectiveError(RuntimeError):
    """A shared-memory collective failed: a peer ran another collective, exited, or timed
    out. The group's transport cannot be used after this."""


def supported() -> bool:
    """Whether this process can use the transport at all (Linux, x86-64, a writable
    ``/dev/shm`` or ``HYPERFSDP_SHM_DIR``)."""
    directory = shm_dir()
    return (
        sys.platform.startswith("linux")
        and platform.machine() in ("x86_64", "AMD64")
        and os.path.isdir(directory)
        and os.access(directory, os.W_OK)
    )


#: the largest segment gloo's ring all-reduce cuts a buffer into (gloo's default, as
#: measured against torch 2.13's gloo; :meth:`ShmGroup.check_ring_order` confirms it per
#: group before the transport reduce-scatters over more than two ranks)
RING_MAX_SEGMENT_BYTES = 1 << 20


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def ring_owner_runs(n: int, size: int, world: int, rank: int) -> list[tuple[int, int, int]]:
    """Where gloo's ring all-reduce of ``world`` chunks of ``n`` elements of ``size`` bytes
    finishes each element of chunk ``rank``: ``(start, stop, rank it is reduced on)`` runs,
    relative to the chunk. The ring cuts the buffer into a multiple of ``world`` segments
    (at least two per rank, at most ``RING_MAX_SEGMENT_BYTES`` each, rounded up to whole
    elements) and reduces each rank's share of segments on that rank; the shares do not
    quite line up with the chunks, so a chunk can start with elements of another rank's."""
    total = world * n * size
    limit = size * max(1, RING_MAX_SEGMENT_BYTES // size)
    segments = _round_up(max(_ceil_div(total, limit), 2 * world), world)
    seg_bytes = _round_up(_ceil_div(total, segments), size)
    share = (segments // world) * seg_bytes // size  # elements reduced on each rank
    runs = []
    start, stop = rank * n, (rank + 1) * n
    g = start
    while g < stop:
        owner = g // share
        end = min(stop, (owner + 1) * share)
        runs.append((g - start, end - start, owner))
        g = end
    return runs


def order_probe(world: int, dtype: torch.dtype) -> list[float]:
    """One value per rank such that the ring's sums for neighbouring owners differ:
    ``((x[o-1] + x[o-2]) + ...) + x[o]`` changes with ``o`` for every ``o`` (found by a
    seeded search, the same on every rank; over two ranks any values, as their sum
    commutes)."""
    gen = torch.Generator().manual_seed(world)
    if world <= 2:
        return [float(v) for v in (torch.randn(world, generator=gen) * 64).to(dtype)]
    for _ in range(10000):
        x = list((torch.randn(world, generator=gen) * 64).to(dtype))
        sums = []
        for o in range(world):
            acc = x[(o - 1) % world] + x[(o - 2) % world]
            for k in range(3, world + 1):
                acc = acc + x[(o - k) % world]
            sums.append(acc)
        if all(not torch.equal(sums[o], sums[o - 1]) for o in range(world)):
            return [float(v) for v in x]
    raise RuntimeError(f"no order probe found for {world} ranks")


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: it exists and is not a zombie (exited, not yet
    reaped by its parent, as ranks launched with ``Process.join()`` in order are)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc: existing is all we can tell
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


class _Segment:
    """One member's mapped segment: its header (int64 words) and its slots (bytes)."""

    __slots__ = ("address", "header", "mm", "slots")

    def __init__(self, mm: mmap.mmap, header_bytes: int) -> None:
        self.mm = mm
        self.header = memoryview(mm)[:header_bytes].cast("q")
        # where the header lives in this process, for futex calls on its words
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        # made at a group's first collective, which may run under inference_mode: the
        # slots must be normal tensors, written in place outside it too
        with torch.inference_mode(False):
            data = torch.frombuffer(mm, dtype=torch.uint8, offset=header_bytes)
            self.slots = [data[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES] for i in range(SLOTS)]


def _header_bytes(world: int) -> int:
    return max(4096, math.ceil(8 * (_ACK + world) / 4096) * 4096)


def _exchange(group, world: int, value) -> list:
    """``value`` of every member (gloo's ``all_gather_object``)."""
    out: list = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def _create(path: str, size: int, token: int, header_bytes: int) -> mmap.mmap | None:
    """Create and map this member's segment, its token in the header; None where it
    cannot (a full or missing directory: the group keeps gloo)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # reserve the pages now: a full /dev/shm (a container's default is 64 MiB)
            # then fails here, and gloo is kept, instead of a SIGBUS later
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        memoryview(mm)[:header_bytes].cast("q")[_TOKEN] = token
    except OSError:
        return None
    return mm


def _note_failed_setup(exc: BaseException, group, rank: int, step: str, infos: list) -> None:
    """Say on ``exc`` (gloo's error, most often) that the shared-memory setup failed, where,
    and which members' processes have exited (those on this host, when known)."""
    try:
        ranks = dist.get_process_group_ranks(group) if group is not None else "of the default group"
    except Exception:  # the group may be gone
        ranks = "unknown"
    gone = []
    if infos and infos[rank][2][1] is not None:  # the members on this host (and PID namespace)
        here = [
            (m, info[1]) for m, info in enumerate(infos) if m != rank and info[2] == infos[rank][2]
        ]
        # a killed peer's sockets close while it exits: give it a moment to be gone
        deadline = time.monotonic() + _LIVENESS_EVERY
        while here:
            gone = [f"group rank {m} (pid {pid})" for m, pid in here if not _alive(pid)]
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
    died = f"; {', '.join(gone)} exited" if gone else ""
    exc.add_note(
        f"hyperfsdp-shm: setting up the shared-memory transport of the group (ranks {ranks}) "
        f"failed while {step}{died}; every member's segment file in {shm_dir()} was "
        "removed. If a peer died or stopped, its own log says why; HYPERFSDP_SHM=0 keeps "
        "gloo for this job."
    )


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class ShmGroup:
    """The shared-memory transport of one process group (see the module docstring)."""

    def __init__(self, group, rank: int, world: int, segments, pids, timeout: float) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self.peers = [p for p in range(world) if p != rank]
        self._headers = [s.header for s in segments]
        self._addresses = [s.address for s in segments]
        self._slots = [s.slots for s in segments]
        self._typed: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._pids = pids  # peers' process ids, or None when they cannot be checked
        self.timeout = timeout
        self.chunks = 0  # chunks each member has published so far (equal on all)
        self.ops = 0  # collectives run so far (equal on all)
        self.failed: str | None = None
        #: whether :meth:`reduce_scatter` adds in gloo's order (always over two ranks;
        #: over more, checked against gloo when the transport is made)
        self.ring_order = world == 2
        self._plans: dict[int, tuple[object, list]] = {}

    # -- setup -----------------------------------------------------------------------------
    @classmethod
    def create(cls, group, rank: int, world: int, timeout: timedelta) -> ShmGroup | None:
        """The transport for ``group``, or None where some member cannot use it.

        Collective over ``group``: every member calls it at the same point (three
        ``all_gather_object``). The members first tell each other the names their segments
        will have, then each creates and maps its own, then maps the others'. Every member
        unlinks every member's name when the setup ends: once all are mapped, or when it
        fails on the way (a peer that never comes, dies or stops; an exception here), so
        that a member killed after creating its segment leaves nothing in the directory
        either: the survivors remove its file. A failure's exception gets a note saying
        so, naming the members whose processes have exited.
        """
        header_bytes = _header_bytes(world)
        size = header_bytes + SLOTS * CHUNK_BYTES
        token = secrets.randbits(62)
        path = None
        if supported():
            path = os.path.join(shm_dir(), f"hyperfsdp-{uuid.uuid4().hex}-{rank}")
        names: list = [path]
        infos: list = []
        step = "exchanging the segments' names"
        try:
            here = (socket.gethostname(), _pid_namespace())
            infos = _exchange(group, world, (path, os.getpid(), here))
            names = [info[0] for info in infos]
            step = "creating and mapping the segments"
            mm = _create(path, size, token, header_bytes) if path is not None else None
            return cls._agree(group, rank, world, timeout, infos, mm, token, size, header_bytes)
        except BaseException as exc:
            _note_failed_setup(exc, group, rank, step, infos)
            raise
        finally:  # mapped by every member now, or the setup failed: the names can go
            for name in names:
                if name is not None:
                    try:
                        os.unlink(name)
                    except OSError:
                        pass

    @classmethod
    def _agree(cls, group, rank, world, timeout, infos, mm, token, size, header_bytes):
        """The rest of :meth:`create`: exchange the segments' tokens, map the members'
        segments, and agree whether every member could."""
        tokens = _exchange(group, world, token if mm is not None else None)
        segments = None
        if all(t is not None for t in tokens):
            segments = []
            try:
                for member, (peer_path, _, _) in enumerate(infos):
                    peer_mm = mm if member == rank else _map(peer_path, size)
                    seg = _Segment(peer_mm, header_bytes)
                    if seg.header[_TOKEN] != tokens[member]:  # another host's file of that name
                        raise OSError("token mismatch")
                    segments.append(seg)
            except (OSError, ValueError):
                segments = None
        oks = _exchange(group, world, segments is not None)
        if not all(oks):
            return None
        namespaces = {info[2][1] for info in infos}  # all on this host: they mapped its files
        pids = None
        if len(namespaces) == 1 and None not in namespaces:
            pids = {member: info[1] for member, info in enumerate(infos) if member != rank}
        transport = cls(group, rank, world, segments, pids, timeout.total_seconds())
        if world > 2:
            transport.ring_order = transport.check_ring_order()
        return transport

    # -- the protocol ----------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        self._poison(message)
        raise ShmCollectiveError(message)

    def _poison(self, message: str) -> None:
        """This group's transport is out of step from now on: say why (every later call
        raises it) and tell the peers, whose waits for this rank then fail at once
        instead of timing out."""
        if self.failed is None:
            self.failed = message
        self._headers[self.rank][_POISON] = 1

    def _await(self, member: int, word: int, target: int) -> None:
        """Wait until ``member``'s header word ``word`` reaches ``target``: poll briefly,
        then sleep between polls (see :data:`_SPIN_S`)."""
        header = self._headers[member]
        if header[word] >= target:
            return
        clock = time.perf_counter
        start = clock()
        while clock() - start < _SPIN_S:
            if header[word] >= target:
                return
        check = start + _LIVENESS_EVERY
        pause = _FIRST_PAUSE_S
        mine = self._headers[self.rank]
        address = self._addresses[member] + 8 * word
        while header[word] < target:
            if header[_POISON]:
                self._fail(
                    f"group rank {member} failed during shared-memory collective #{self.ops} "
                    "(its own error is in its log)"
                )
            if _syscall is None:
                time.sleep(pause)
            else:
                mine[_WAITING] = 1
                seen = header[word]
                if seen < target:  # else stored meanwhile; the futex returns at once if so
                    limit = _Timespec(0, int(pause * 1e9))
                    _syscall(
                        _SYS_FUTEX,
                        ctypes.c_void_p(address),
                        _FUTEX_WAIT,
                        _as_int32(seen),
                        ctypes.byref(limit),
                        None,
                        0,
                    )
                mine[_WAITING] = 0
            pause = min(pause * 2, _MAX_PAUSE_S)
            now = clock()
            if now >= check:
                check = now + _LIVENESS_EVERY
                if now - start > self.timeout:
                    self._fail(
                        f"shared-memory collective #{self.ops} timed out after "
                        f"{self.timeout:g} s waiting for group rank {member}"
                    )
                pid = self._pids.get(member) if self._pids else None
                if pid is not None and not _alive(pid):
                    self._fail(
                        f"group rank {member} (pid {pid}) exited during "
                        f"shared-memory collective #{self.ops}"
                    )

    def _wake(self, word: int, members) -> None:
        """This rank just stored its header word ``word``: wake those of ``members`` that
        block (they may wait on it)."""
        if _syscall is None:
            return
        headers = self._headers
        for m in members:
            if headers[m][_WAITING]:
                address = self._addresses[self.rank] + 8 * word
                _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 1 << 30, None, None, 0)
                return

    def _run(self, kind: int, nbytes: int, n_chunks: int, put, take) -> None:
        """One collective: ``put(i, slot)`` writes this rank's chunk ``i`` into its slot
        number ``slot``; once every peer has published its chunk ``i``, ``take(i, slot)``
        consumes them (each from that peer's slot ``slot``)."""
        if self.failed is not None:
            raise ShmCollectiveError(
                f"this group's shared-memory transport failed earlier ({self.failed}); "
                "re-create the process group, or set HYPERFSDP_SHM=0 to use gloo"
            )
        try:
            self._steps(kind, nbytes, n_chunks, put, take)
        except ShmCollectiveError:
            raise
        except BaseException as exc:  # a copy failed, KeyboardInterrupt, ...: out of step
            self._poison(
                f"{type(exc).__name__} inside shared-memory collective #{self.ops - 1}: {exc}"
            )
            raise

    def _steps(self, kind: int, nbytes: int, n_chunks: int, put, take) -> None:
        tag = hash((self.ops, kind, nbytes)) & ((1 << 62) - 1)
        self.ops += 1
        me, peers = self.rank, self.peers
        mine = self._headers[me]
        base = self.chunks
        written = read = 0
        while read < n_chunks:
            while written < n_chunks and written - read < SLOTS:
                c = base + written
                if c >= SLOTS:
                    for p in peers:  # every peer is done with this slot's last chunk
                        self._await(p, _ACK + me, c - SLOTS + 1)
                slot = c % SLOTS
                put(written, slot)
                mine[_TAG + slot] = tag
                mine[_PUB] = c + 1
                self._wake(_PUB, peers)
                written += 1
            c = base + read
            slot = c % SLOTS
            for p in peers:
                self._await(p, _PUB, c + 1)
                if self._headers[p][_TAG + slot] != tag:
                    self._fail(
                        f"group rank {p} ran another collective than this rank's "
                        f"#{self.ops - 1} (kind {kind}, {nbytes} bytes): every member must "
                        "run the same collectives in the same order"
                    )
            take(read, slot)
            for p in peers:
                mine[_ACK + p] = c + 1
                self._wake(_ACK + p, (p,))
            read += 1
        self.chunks = base + n_chunks

    # -- collectives -----------------------------------------------------------------------
    def all_gather_rows(self, rows: list[torch.Tensor]) -> None:
        """All-gather into ``(world, n)`` views: this rank has written its row of each;
        every peer's rows arrive into place. ``rows`` is a bucket's cached list: its
        chunk plan is built once."""
        entry = self._plans.get(id(rows))
        if entry is None or entry[0] is not rows:
            if len(self._plans) >= _MAX_PLANS:  # buckets rebuilt many times: start afresh
                self._plans.clear()
            with torch.inference_mode(False):  # kept: normal tensors, as the slots
                entry = self._plans[id(rows)] = (rows, self._plan(rows))
        self._gather(*entry[1])

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """All-gather ``inp`` (this rank's part) into ``out`` (rank-major, contiguous)."""
        rows = out.view(self.world, -1)
        if inp.data_ptr() != rows[self.rank].data_ptr():
            rows[self.rank].copy_(inp.view(-1))
        self._gather(*self._plan([rows]))

    @staticmethod
    def _plan(rows: list[torch.Tensor]) -> tuple[list[torch.Tensor], list, int]:
        """The rows as bytes, their concatenation cut into chunks (per chunk, its pieces
        ``(row index, start, stop, offset in the slot)``), and its byte count."""
        rows8 = [r.view(torch.uint8) for r in rows]
        plan: list = []
        pieces: list = []
        fill = 0
        for index, r in enumerate(rows8):
            n, start = r.shape[1], 0
            while start < n:
                take = min(n - start, CHUNK_BYTES - fill)
                pieces.append((index, start, start + take, fill))
                start += take
                fill += take
                if fill == CHUNK_BYTES:
                    plan.append(pieces)
                    pieces, fill = [], 0
        if pieces:
            plan.append(pieces)
        return rows8, plan, sum(r.shape[1] for r in rows8)

    def _gather(self, rows8: list[torch.Tensor], plan: list, nbytes: int) -> None:
        me, peers, slots = self.rank, self.peers, self._slots

        def put(i, slot):
            dst = slots[me][slot]
            for index, start, stop, at in plan[i]:
                dst[at : at + stop - start].copy_(rows8[index][me, start:stop])

        def take(i, slot):
            for member in peers:
                src = slots[member][slot]
                for index, start, stop, at in plan[i]:
                    rows8[index][member, start:stop].copy_(src[at : at + stop - start])

        self._run(1, nbytes, len(plan), put, take)

    def reduce_scatter_pair(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Sum-reduce-scatter over two ranks: ``out`` = this rank's half of ``inp`` plus
        the peer's half for this rank, one addition per element (which commutes, so the
        result is gloo's bit for bit)."""
        me = self.rank
        halves = inp.view(2, -1)
        own, theirs = halves[me], halves[1 - me]
        typed = self._typed_slots(inp.dtype)
        per = CHUNK_BYTES // inp.element_size()
        n = own.numel()

        def put(i, slot):
            lo, hi = i * per, min(n, (i + 1) * per)
            typed[me][slot][: hi - lo].copy_(theirs[lo:hi])

        def take(i, slot):
            lo, hi = i * per, min(n, (i + 1) * per)
            torch.add(typed[1 - me][slot][: hi - lo], own[lo:hi], out=out[lo:hi])

        self._run(2, n * inp.element_size(), _ceil_div(n, per), put, take)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Sum-reduce-scatter over any number of ranks, added in the order of gloo's ring
        all-reduce (which gloo's ``reduce_scatter_tensor`` runs), so that the result is
        gloo's bit for bit: an element that the ring reduces on rank ``o`` is
        ``((x[o-1] + x[o-2]) + ...) + x[o]`` (members modulo the world size), and which
        rank that is follows from how the ring cuts the buffer (:func:`ring_owner_runs`;
        checked against gloo when the transport is made, see :meth:`check_ring_order`).

        Chunk ``i`` of a rank's stream holds piece ``i`` of its part for every peer; once
        every peer has published chunk ``i``, each rank adds its pieces in that order
        straight from the peers' slots into ``out``."""
        if self.world == 2:
            self.reduce_scatter_pair(out, inp)
            return
        me, world, peers = self.rank, self.world, self.peers
        parts = inp.view(world, -1)
        n = parts.shape[1]
        size = inp.element_size()
        runs = ring_owner_runs(n, size, world, me)
        typed = self._typed_slots(inp.dtype)
        per = CHUNK_BYTES // (world - 1) // size  # elements of one piece
        # where this rank's pieces sit in each peer's slot, and its own for each peer
        at = {p: (me if me < p else me - 1) * per for p in peers}
        mine_at = {q: (q if q < me else q - 1) * per for q in peers}

        def put(i, slot):
            lo, hi = i * per, min(n, (i + 1) * per)
            dst = typed[me][slot]
            for q in peers:
                dst[mine_at[q] : mine_at[q] + hi - lo].copy_(parts[q][lo:hi])

        def take(i, slot):
            lo, hi = i * per, min(n, (i + 1) * per)
            for a, b, owner in runs:
                a, b = max(a, lo), min(b, hi)
                if a >= b:
                    continue

                def piece(member, a=a, b=b):
                    if member == me:
                        return parts[me][a:b]
                    return typed[member][slot][at[member] + a - lo : at[member] + b - lo]

                acc = out[a:b]
                torch.add(piece((owner - 1) % world), piece((owner - 2) % world), out=acc)
                for k in range(3, world):
                    acc.add_(piece((owner - k) % world))
                acc.add_(piece(owner))

        self._run(3, n * size, _ceil_div(n, per), put, take)

    def check_ring_order(self) -> bool:
        """Whether :meth:`reduce_scatter` gives gloo's ``reduce_scatter_tensor`` bit for bit
        on this group (collective), for fp32 and bf16 at sizes where the ring's cut falls
        inside a rank's chunk and where it cuts the buffer into more segments than two
        per rank. Every element holds :func:`order_probe` values, whose sums in the
        orders of neighbouring ranks differ: an element reduced on another rank than
        predicted changes the result. Every member learns the same answer."""
        import torch.distributed as dist

        gloo_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or (
            dist.reduce_scatter_tensor
        )
        ok = True
        for dtype in (torch.float32, torch.bfloat16):
            value = order_probe(self.world, dtype)[self.rank]
            size = torch.tensor([], dtype=dtype).element_size()
            for n in (3, 1001, 2 * RING_MAX_SEGMENT_BYTES // size + 5):
                pack = torch.full((self.world * n,), value, dtype=dtype)
                expect = torch.empty(n, dtype=dtype)
                gloo_reduce_scatter(expect, pack.clone(), group=self.group)
                mine = torch.empty(n, dtype=dtype)
                self.reduce_scatter(mine, pack)
                ok = ok and bool(torch.equal(mine, expect))
        flags: list = [None] * self.world
        dist.all_gather_object(flags, ok, group=self.group)
        return all(flags)

    def _typed_slots(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        typed = self._typed.get(dtype)
        if typed is None:
            with torch.inference_mode(False):
                typed = [[s.view(dtype) for s in slots] for slots in self._slots]
            self._typed[dtype] = typed
        return typed
