"""A pool of persistent rank processes per world size, driven over pipes."""

from __future__ import annotations

import atexit
import faulthandler
import importlib.util
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing import connection, get_all_start_methods, get_context
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

DEFAULT_TIMEOUT = float(os.environ.get("HYPERFSDP_TEST_TIMEOUT", "180"))
STARTUP_TIMEOUT = 300.0
#: After one rank fails, how long the others get to finish before the pool is rebuilt.
FAILURE_GRACE = 3.0


class RankFailure(AssertionError):
    """A rank raised; the message carries that rank's traceback."""


class RankTimeout(AssertionError):
    """Some ranks did not finish within the timeout; the pool was rebuilt."""


def current_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


# -- worker side ---------------------------------------------------------------------------------


def _worker_main(
    rank: int, world_size: int, store_path: str, conn, pg_timeout: float, environ: dict
) -> None:
    # a forkserver child starts with the server's environment: take the driver's, as a
    # spawned process would
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["HYPERFSDP_TEST_RANK"] = str(rank)
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    # A rank killed by a signal (a segfault in native code) cannot answer over its pipe, and
    # its stderr belongs to whichever test started the pool: write every thread's Python
    # stack to a file the driver reads into the RankFailure instead.
    faulthandler.enable(open(_fault_log(store_path, rank), "w"), all_threads=True)  # noqa: SIM115
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
    )
    import gc

    import hyperfsdp_core  # noqa: F401  (imported once, before the freeze below)

    # Everything alive now (torch, the process group) lives as long as the process:
    # move it out of the collector's reach, so that the gc.collect() before every
    # call scans only what tests create (~100 ms -> well under 1 ms per call).
    gc.collect()
    gc.freeze()
    world = dist.group.WORLD
    conn.send(("ready", rank))
    baseline_env = dict(os.environ)
    while True:
        try:
            header = conn.recv()
        except EOFError:
            break
        if header is None:
            break
        module_name, path, qualname, sys_path, selection = header
        payload = conn.recv_bytes()
        try:
            for entry in sys_path:
                if entry not in sys.path:
                    sys.path.append(entry)
            # the driver's plugin selection (autoload, disabled plugins) as of this call
            for key, value in selection.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            fn = _resolve(module_name, path, qualname)
            args, kwargs = pickle.loads(payload)
            _reset_process_state(torch)
            result = fn(*args, **kwargs)
            reply = ("ok", result)
        except BaseException as exc:  # report everything, including assertion errors
            reply = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        finally:
            os.environ.clear()
            os.environ.update(baseline_env)
        # Retire the pool after a call that replaced the c10d world (torch keeps caches
        # keyed by mesh layout whose entries would then name groups of the old world), or
        # that left too many threads behind.
        retire = dist.group.WORLD is not world or _native_thread_count() > MAX_THREADS
        try:
            data = pickle.dumps((reply, retire))
        except Exception as exc:
            data = pickle.dumps((("error", f"result not picklable: {exc!r}", ""), retire))
        conn.send_bytes(data)
    dist.destroy_process_group()


def _fault_log(store_path: str, rank: int) -> str:
    return f"{store_path}.rank{rank}.fault"


def _fault_report(store_path: str, rank: int) -> str:
    """What ``faulthandler`` wrote for ``rank`` (its threads' stacks when a signal killed
    it), or ``""``."""
    try:
        with open(_fault_log(store_path, rank)) as f:
            return f.read()
    except OSError:
        return ""


#: how many threads a rank process may keep across calls before its pool is replaced: every
#: process group a test makes (a mesh makes one per dimension) keeps gloo threads that go on
#: polling after the test (measured: 0.002 CPU-s/s per group and process, idle; a world-4
#: pool of the whole suite ended with ~190 groups, 580 threads per rank). A pool starts
#: with 4; torch has no public way to list the groups, and threads are what cost. (A pool
#: is replaced, too, after a call that replaced the c10d world.)
MAX_THREADS = 64


def _native_thread_count() -> int:
    """This process's threads, native ones included (0 where ``/proc`` does not say)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _resolve(module_name: str, path: str | None, qualname: str) -> Callable:
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            if path is None:
                raise
            spec = importlib.util.spec_from_file_location(module_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _reset_process_state(torch) -> None:
    import gc

    gc.collect()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32)
    from hyperfsdp_core.plugin.manager import reset_plugin_manager

    reset_plugin_manager()


# -- driver side -----------------------------------------------------------------------------------


#: what the forkserver of :func:`run_on_ranks`'s processes imports once, so that each rank
#: starts as a fork of it (~10 ms) instead of a fresh interpreter importing torch (~2 s CPU)
PRELOAD = ("torch", "torch.distributed", "hyperfsdp_core")


def _preloaded_context():
    """A ``forkserver`` context whose server has imported :data:`PRELOAD` (``spawn`` where
    the platform has no forkserver). The server is a fresh interpreter started on first
    use, so nothing of the driver's state (patched modules, threads) reaches the ranks."""
    if "forkserver" not in get_all_start_methods():
        return get_context("spawn")
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def spawn_ranks(
    world_size: int,
    target: Callable[..., object],
    args: Callable[[int, Connection], tuple],
    name: Callable[[int], str],
    preloaded: bool = False,
) -> tuple[list[Connection], list[BaseProcess]]:
    """Start ``world_size`` daemon processes (``spawn``), each with a pipe to this one: rank
    ``r``'s runs ``target(*args(r, conn))``, ``conn`` being its end of the pipe, under the
    process name ``name(r)``. Returns this process's ends of the pipes and the processes,
    in rank order.

    The rank processes of the benchmark suite start so (fresh interpreters: nothing shared
    that would blur their memory figures); ``preloaded=True`` forks them from a server that
    has imported torch (:func:`_preloaded_context`), as :func:`run_on_ranks` does.
    """
    ctx = _preloaded_context() if preloaded else get_context("spawn")
    conns, procs = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=args(rank, child), daemon=True, name=name(rank))
        proc.start()
        child.close()
        conns.append(parent)
        procs.append(proc)
    return conns, procs


def _plugin_selection() -> dict[str, str | None]:
    """The driver's plugin-selection variables, which each rank applies for the call (the
    ranks' plugin manager is rebuilt from them), as the driver's own manager would."""
    from hyperfsdp_core.plugin.manager import DISABLE_AUTOLOAD_ENV, PLUGINS_DISABLE_ENV

    return {key: os.environ.get(key) for key in (DISABLE_AUTOLOAD_ENV, PLUGINS_DISABLE_ENV)}


class RankPool:
    """``world_size`` processes with a shared gloo process group, kept across tests."""

    def __init__(self, world_size: int, pg_timeout: float = DEFAULT_TIMEOUT) -> None:
        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory(prefix="hyperfsdp-pool-")
        store_path = self._store_path = os.path.join(self._tmp.name, "store")
        environ = dict(os.environ)
        self.conns, self.procs = spawn_ranks(
            world_size,
            _worker_main,
            lambda rank, conn: (rank, world_size, store_path, conn, pg_timeout, environ),
            lambda rank: f"hyperfsdp-rank{rank}-of-{world_size}",
            preloaded=True,
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise RankTimeout(
                    f"rank {rank} of {world_size} did not start within {STARTUP_TIMEOUT:.0f}s"
                )
            try:
                conn.recv()
            except (EOFError, OSError):
                self.procs[rank].join(timeout=5)
                code = self.procs[rank].exitcode
                fault = _fault_report(store_path, rank)
                self.close()
                raise RankFailure(
                    f"rank {rank} of {world_size} died while starting (exit code {code}); "
                    + (f"its stacks:\n{fault}" if fault else "its error is above, on stderr")
                ) from None

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        module = sys.modules.get(fn.__module__)
        header = (
            fn.__module__,
            getattr(module, "__file__", None),
            fn.__qualname__,
            list(sys.path),
            _plugin_selection(),
        )
        payload = pickle.dumps((args, kwargs))
        for conn in self.conns:
            conn.send(header)
            conn.send_bytes(payload)
        results: dict[int, tuple] = {}
        retire = False
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout
        failed_at = None
        while pending:
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + FAILURE_GRACE)
            if now >= limit:
                break
            ready = connection.wait(list(pending.values()), timeout=limit - now)
            for conn in ready:
                rank = self.conns.index(conn)
                try:
                    results[rank], retired = pickle.loads(conn.recv_bytes())
                    retire = retire or retired
                except (EOFError, OSError):
                    self.procs[rank].join(timeout=5)  # reap it, so that the exit code is known
                    code = self.procs[rank].exitcode
                    fault = _fault_report(self._store_path, rank)
                    results[rank] = ("error", f"rank {rank} process died (exit code {code})", fault)
                del pending[rank]
                if results[rank][0] == "error" and failed_at is None:
                    failed_at = time.monotonic()
        errors = sorted((r, res) for r, res in results.items() if res[0] == "error")
        if pending:
            self.close(stuck=pending)  # the pool cannot be reused
        elif retire:
            # fresh processes (a fork each) for the next call; every rank has answered, so
            # none is inside a collective and none need wait
            self.close(stuck=range(self.world_size))
        if errors:
            rank, (_, summary, tb) = errors[0]
            others = "".join(f"\n(rank {r} also failed: {res[1]})" for r, res in errors[1:])
            stuck = f"\n(ranks {sorted(pending)} did not finish)" if pending else ""
            raise RankFailure(
                f"rank {rank} of {self.world_size} failed: {summary}\n{tb}{others}{stuck}"
            )
        if pending:
            raise RankTimeout(
                f"ranks {sorted(pending)} of {self.world_size} did not finish within {timeout:.0f}s "
                "(hung?); the rank processes were killed and will be restarted"
            )
        return [results[r][1] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def close(self, stuck: Iterable[int] = ()) -> None:
        """Stop the rank processes; ``stuck`` ranks are killed without waiting for them."""
        for rank in stuck:
            self.procs[rank].kill()
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in self.procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        self._tmp.cleanup()


_pools: dict[int, RankPool] = {}


def run_on_ranks(
    world_size: int, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results.

    ``fn`` must be a module-level function (it is imported by name in the rank
    processes), and the arguments and results must be picklable. A rank's exception
    becomes a :class:`RankFailure` carrying its traceback; ranks still running after
    ``timeout`` seconds raise :class:`RankTimeout` and the processes are restarted.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    qualname = getattr(fn, "__qualname__", "")
    if "<" in qualname or not getattr(fn, "__module__", None):
        raise TypeError(
            f"run_on_ranks needs a module-level function (the rank processes import it by "
            f"name), got {fn!r}; move it to the top level of its module"
        )
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.close()
        pool = _pools[world_size] = RankPool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    finally:
        if not pool.alive or not pool.conns:
            # A rank died or hung (stop the survivors too, or they would linger), or the
            # pool was retired (a new c10d world, or too many threads).
            pool.close()
            _pools.pop(world_size, None)


def close_pools() -> None:
    """Stop every rank process (called at the end of a pytest session and at exit)."""
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()


atexit.register(close_pools)
