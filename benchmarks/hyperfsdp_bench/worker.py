"""The rank process: builds one implementation and runs timed steps on command.

One process per rank *per implementation*: every implementation of a case gets
its own fresh rank processes (started together, driven in turn), so resident
memory, allocator state and collective counts are per implementation. Keep the
module-level imports to the standard library: the collective counter must be
installed before anything binds ``torch.distributed`` functions.
"""

from __future__ import annotations

import os
import resource
import time
import traceback
from datetime import timedelta


def worker_main(
    impl: str, rank: int, world: int, store_path: str, threads: int, distributed: bool, conn
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler of ``counts``: no banner
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch

    torch.set_num_threads(threads)
    from .measure import CollectiveCounter

    counter = CollectiveCounter()
    counter.install()
    try:
        if distributed:
            import torch.distributed as dist

            store = dist.FileStore(store_path, world)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
            )
        counter.install()  # again: catches aliases bound by modules imported since
        conn.send(("ready", rank))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    runner = Runner(impl, rank, world, counter)
    runner.rss_at_start = _rss()
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None or msg[0] == "stop":
            break
        try:
            result = getattr(runner, msg[0])(*msg[1:])
            conn.send(("ok", result))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _rss() -> int | None:
    from .measure import rss_bytes

    return rss_bytes()


class Runner:
    def __init__(self, impl: str, rank: int, world: int, counter) -> None:
        self.impl = impl
        self.rank = rank
        self.world = world
        self.counter = counter
        self.built = None
        self.batches: list = []
        self.step_index = 0
        self.peak_reset = False
        self.rss_at_start: int | None = None

    # -- commands ------------------------------------------------------------------------------
    def setup(self, spec, warmup: int) -> dict:
        """Build, run ``warmup`` steps (their losses feed the correctness guard), measure state."""
        import torch

        from . import impls, measure
        from .model import make_batches

        counter = self.counter
        t0 = time.perf_counter()
        self.built = impls.build(self.impl, spec)
        counter.install()
        self.batches = make_batches(spec.model, spec.seed, impls.data_rank(spec, self.rank), 8)
        build_s = time.perf_counter() - t0
        losses = [self._step()[0] for _ in range(max(warmup, 1))]
        model = self.built.model
        info = {
            "rank": self.rank,
            "build_s": build_s,
            "warmup_losses": losses,
            "n_params_global": spec.model.n_params,
            "n_units": self.built.n_units,
            **measure.live_state_bytes(self.built.state_model or model, self.built.optimizer),
            "rss_at_start": self.rss_at_start,
            "rss_after_setup": measure.rss_bytes(),
            "peak_rss_setup": measure.peak_rss_bytes(),
            "counter_installed": list(counter.installed),
            "counter_aliases": sorted(set(counter.aliases)),
            "threads": torch.get_num_threads(),
        }
        base = impls.parse_impl(self.impl)[0]
        if base == "hyperfsdp":
            info.update(measure.hyperfsdp_padding_bytes(model))
        elif base == "fsdp2":
            info.update(measure.fsdp2_padding_bytes(model))
        else:
            info.update({"padding_bytes": 0, "padded_params": 0, "n_managed": 0})
        with measure.HeapPeak() as heap:  # one untimed step, sampled for peak heap in use
            start = heap.peak
            self._step()
        info["peak_heap"] = heap.peak
        info["heap_at_step_start"] = start
        self.peak_reset = measure.reset_peak_rss()
        return info

    def run(self, steps: int) -> dict:
        """``steps`` timed steps: wall and CPU time per step, collectives, peak RSS so far."""
        from . import measure

        calls0, bytes0 = self.counter.snapshot()
        comm_stats0 = self._comm_stats()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        wall, cpu, losses, fwd_bwd, optim = [], [], [], [], []
        perf, proc = time.perf_counter, time.process_time
        for _ in range(steps):
            c0, t0 = proc(), perf()
            loss, t_opt = self._step()
            t1, c1 = perf(), proc()
            losses.append(loss)
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
            fwd_bwd.append(t_opt - t0)
            optim.append(t1 - t_opt)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        calls1, bytes1 = self.counter.snapshot()
        comm_stats1 = self._comm_stats()
        out = {
            # minor page faults: memory the allocator took fresh from the kernel and touched
            "page_faults": faults,
            "wall": wall,
            "cpu": cpu,
            "fwd_bwd": fwd_bwd,  # zero_grad + forward + backward
            "optim": optim,  # optimizer.step()
            "losses": losses,
            "calls": measure.diff(calls1, calls0),
            "bytes": measure.diff(bytes1, bytes0),
            "peak_rss": measure.peak_rss_bytes(),
            "peak_reset": self.peak_reset,
            "rss": measure.rss_bytes(),
        }
        if comm_stats0 is not None and comm_stats1 is not None:
            out["hyperfsdp_comm_stats"] = measure.diff(comm_stats1, comm_stats0)
            out["hyperfsdp_pool_bytes"] = getattr(self._comm(), "pooled_bytes", None)
        if self.impl == "ddp":
            from .impls import ddp_comm

            per_step = ddp_comm(self.built.model)
            out["calls"] = {k: v * steps for k, v in per_step["calls"].items()}
            out["bytes"] = {k: v * steps for k, v in per_step["bytes"].items()}
            out["comm_source"] = "ddp_logging_data"
        return out

    def profile(self, steps: int, path: str, timer: str = "wall", ranks: tuple = (0,)) -> dict:
        """``steps`` steps under cProfile on ``ranks``; stats dumped to ``path``.

        ``timer="cpu"`` profiles this thread's CPU time (``time.thread_time``): immune
        to preemption by other processes, blind to waits.
        """
        import cProfile

        if self.rank not in ranks:
            return self.run(steps)
        prof = cProfile.Profile(time.thread_time) if timer == "cpu" else cProfile.Profile()
        prof.enable()
        out = self.run(steps)
        prof.disable()
        prof.dump_stats(path.format(impl=self.impl, rank=self.rank))
        return out

    def counts(self) -> dict:
        """One untimed step with its copies and allocations counted
        (``measure.count_copies_and_allocations``); run after the timed rounds, so the
        profiler's own memory cannot move the peak RSS they measure."""
        from .measure import count_copies_and_allocations

        out = count_copies_and_allocations(self._step)
        out["rank"] = self.rank
        return out

    def timeline(self) -> dict:
        """One untimed step with the heap sampled and forward/backward/optimizer marked."""
        from .timeline import record_step

        batch = self.batches[self.step_index % len(self.batches)]
        self.step_index += 1
        out = record_step(self.built, batch, self.counter)
        out["rank"] = self.rank
        return out

    def pid(self) -> int:
        return os.getpid()

    # -- one training step ---------------------------------------------------------------------
    def _step(self) -> tuple[float, float]:
        """One step; returns the loss and when (``perf_counter``) the optimizer step began."""
        built = self.built
        tokens, targets = self.batches[self.step_index % len(self.batches)]
        self.step_index += 1
        built.optimizer.zero_grad(set_to_none=True)
        with built.autocast():
            loss = built.model(tokens, targets)
        loss.backward()
        t_opt = time.perf_counter()
        built.optimizer.step()
        return float(loss.detach()), t_opt

    def _comm(self):
        if not self.impl.startswith("hyperfsdp") or self.built is None:
            return None
        state = getattr(self.built.model, "_hyperfsdp_state", None)
        return getattr(state, "comm", None)

    def _comm_stats(self) -> dict | None:
        stats = getattr(self._comm(), "stats", None)
        return stats.snapshot() if stats is not None else None
