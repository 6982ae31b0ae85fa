"""Launching rank processes: one pool of ``world`` spawned processes per implementation."""

from __future__ import annotations

import os
import tempfile
import time
from multiprocessing import connection

from hyperfsdp_core.testing import spawn_ranks

from .worker import worker_main


class PoolError(RuntimeError):
    """A rank raised (message: the first rank's error; ``details``: every rank's traceback)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


class RankPool:
    """``world`` rank processes for one implementation, driven in lockstep over pipes.

    ``distributed``: the ranks join one gloo process group (``impls.needs_process_group``).
    """

    def __init__(self, impl: str, world: int, threads: int, distributed: bool) -> None:
        self.impl = impl
        self.world = world
        self._tmp = tempfile.TemporaryDirectory(prefix=f"hyperfsdp-bench-{impl}-")
        store = os.path.join(self._tmp.name, "store")
        self.conns, self.procs = spawn_ranks(
            world,
            worker_main,
            lambda rank, conn: (impl, rank, world, store, threads, distributed, conn),
            lambda rank: f"bench-{impl}-r{rank}",
        )
        self.ready = False
        self.broken: str | None = None

    def wait_ready(self, timeout: float = 300.0) -> None:
        self._collect(timeout, expect="ready")
        self.ready = True

    def call(self, *msg, timeout: float = 600.0) -> list:
        """Send ``msg`` to every rank; return the ranks' results in rank order."""
        if self.broken:
            raise PoolError(f"{self.impl}: pool unusable after an earlier error: {self.broken}")
        for conn in self.conns:
            conn.send(msg)
        return self._collect(timeout)

    def _collect(self, timeout: float, expect: str = "ok") -> list:
        results: list = [None] * self.world
        pending = dict(enumerate(self.conns))
        errors: list[tuple[int, str, str]] = []
        deadline = time.monotonic() + timeout
        while pending:
            # After one rank fails, the others may be stuck in a collective: short grace.
            left = deadline - time.monotonic()
            if errors:
                left = min(left, 5.0)
            if left <= 0:
                break
            ready = connection.wait(list(pending.values()), timeout=left)
            if not ready:
                break
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    reply = conn.recv()
                except EOFError:
                    code = self.procs[rank].exitcode
                    errors.append((rank, f"rank {rank} died (exit code {code})", ""))
                    del pending[rank]
                    continue
                del pending[rank]
                if reply[0] == expect:
                    results[rank] = reply[1]
                else:
                    errors.append((rank, reply[1], reply[2] if len(reply) > 2 else ""))
        if errors or pending:
            if not errors:
                message = f"timed out after {timeout:.0f}s waiting for ranks {sorted(pending)}"
            else:
                rank, message, _ = errors[0]
                message = f"rank {rank}: {message}"
            details = "\n".join(f"--- rank {r}: {m}\n{tb}" for r, m, tb in errors)
            self.broken = message
            self.close(force=True)
            raise PoolError(f"{self.impl}: {message}", details)
        return results

    def close(self, force: bool = False) -> None:
        if not force:
            for conn in self.conns:
                try:
                    conn.send(("stop",))
                except (BrokenPipeError, OSError):
                    pass
            for proc in self.procs:
                proc.join(timeout=30)
        for proc in self.procs:  # only the processes this pool started
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns = []
        self._tmp.cleanup()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        if self.conns:
            self.close(force=exc[0] is not None)
