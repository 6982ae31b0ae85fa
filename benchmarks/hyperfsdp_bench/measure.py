"""What a rank process measures: collectives, resident memory, live state bytes, padding."""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
from collections import defaultdict

import torch

# name -> how to find the bytes a call moves: ("out"|"in"|"tensor"|"list", positional index)
_COLLECTIVES = {
    "all_gather_into_tensor": ("tensor", 0),  # output: the gathered buffer
    "all_gather_single": ("tensor", 0),
    "_all_gather_base": ("tensor", 0),
    "all_gather": ("list", 0),  # tensor_list output
    "all_gather_coalesced": ("lists", 0),
    "reduce_scatter_tensor": ("tensor", 1),  # input: the full buffer
    "reduce_scatter_single": ("tensor", 1),
    "_reduce_scatter_base": ("tensor", 1),
    "reduce_scatter": ("list", 1),  # input_list
    "all_reduce": ("tensor", 0),
    "all_reduce_coalesced": ("list", 0),
    "broadcast": ("tensor", 0),
    "all_to_all_single": ("tensor", 1),
    "all_to_all": ("list", 1),
    "reduce": ("tensor", 0),
}
_KWARG_NAMES = {
    ("tensor", 0): ("output_tensor", "output", "tensor"),
    ("tensor", 1): ("input_tensor", "input", "input_"),
    ("list", 0): ("tensor_list", "output_tensor_lists", "tensors"),
    ("list", 1): ("input_list", "input_tensor_list"),
    ("lists", 0): ("output_tensor_lists",),
}


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


class CollectiveCounter:
    """Counts every collective issued through ``torch.distributed``'s Python API in this process.

    The wrappers replace the functions in ``torch.distributed`` and
    ``torch.distributed.distributed_c10d`` *and* every module-level alias of them
    already imported (hyperfsdp binds ``dist.all_gather_single`` at import time),
    so hyperfsdp, FSDP2 and anything else calling the Python API share one counter.
    Nested calls (one public collective implemented with another) count once.
    DDP's C++ reducer bypasses the Python API: its all-reduces are counted from
    DDP's own logging data instead (see ``impls.ddp_comm``).
    """

    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self._local = threading.local()
        self.installed: list[str] = []
        self.aliases: list[str] = []
        #: called as ``listener(name, nbytes)`` for every counted call (memory timeline)
        self.listener = None

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        originals = {}
        for name, (kind, index) in _COLLECTIVES.items():
            fn = getattr(c10d, name, None) or getattr(dist, name, None)
            if fn is None or getattr(fn, "_hyperfsdp_bench_wrapped", False):
                continue
            wrapper = self._wrap(name, fn, kind, index)
            originals[id(fn)] = (fn, wrapper)
            for mod in (dist, c10d):
                if getattr(mod, name, None) is fn:
                    setattr(mod, name, wrapper)
            self.installed.append(name)
        # Rebind aliases bound before we got here (``_all_gather = dist.all_gather_single``).
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith(("hyperfsdp", "torch.distributed")):
                continue
            try:
                items = list(vars(mod).items())
            except TypeError:
                continue
            for attr, value in items:
                entry = originals.get(id(value))
                if entry is not None and entry[0] is value:
                    setattr(mod, attr, entry[1])
                    self.aliases.append(f"{mod_name}.{attr}")
        # hyperfsdp's point-to-point all-gather (the core's gloo routes, dim-0 buckets): one
        # all-gather of the unsharded bytes, made of sends and receives the wrappers above do
        # not see; its pair reduce-scatter (one reduce-scatter of the full input); and the
        # same through the hyperfsdp-shm plugin's shared memory, which calls no
        # torch.distributed function at all
        for module, attr, kind, index in (
            ("hyperfsdp_core.comm.gloo", "all_gather_p2p", "list", 0),
            ("hyperfsdp_core.comm.gloo", "reduce_scatter_pair", "tensor", 1),
            ("hyperfsdp_shm._transport", "all_gather_rows_shm", "list", 0),
            ("hyperfsdp_shm._transport", "all_gather_shm", "tensor", 0),
            ("hyperfsdp_shm._transport", "reduce_scatter_shm", "tensor", 1),
        ):
            coll = sys.modules.get(module)
            fn = getattr(coll, attr, None)
            if fn is not None and not getattr(fn, "_hyperfsdp_bench_wrapped", False):
                setattr(coll, attr, self._wrap(attr, fn, kind, index))
                self.installed.append(attr)

    def _wrap(self, name: str, fn, kind: str, index: int):
        local = self._local
        calls, nbytes = self.calls, self.bytes
        kw_names = _KWARG_NAMES.get((kind, index), ())

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            depth = getattr(local, "depth", 0)
            if depth == 0:
                calls[name] += 1
                arg = args[index] if len(args) > index else None
                if arg is None:
                    for k in kw_names:
                        if k in kwargs:
                            arg = kwargs[k]
                            break
                n = _nbytes(arg)
                nbytes[name] += n
                if self.listener is not None:
                    self.listener(name, n)
            local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth = depth

        wrapper._hyperfsdp_bench_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        return dict(self.calls), dict(self.bytes)


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    out = {k: v - before.get(k, 0) for k, v in after.items()}
    return {k: v for k, v in out.items() if v}


# -- memory ----------------------------------------------------------------------------------------


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


def peak_rss_bytes() -> int | None:
    kb = _status_kb("VmHWM")
    return None if kb is None else kb * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _load_mallinfo():
    """glibc's ``mallinfo2`` as a callable, or None (non-glibc, glibc < 2.33)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        names = (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
        fields = [(n, ctypes.c_size_t) for n in names]
        info_type = type("mallinfo2", (ctypes.Structure,), {"_fields_": fields})
        libc.mallinfo2.restype = info_type
        return libc.mallinfo2
    except (OSError, AttributeError):
        return None


class HeapPeak:
    """Peak bytes in use by malloc during a block, sampled by a thread every ``interval`` s.

    glibc's ``mallinfo2`` counts allocated bytes (heap chunks in use plus mmapped
    blocks), independent of fragmentation and of when freed memory is returned to the
    OS; peak RSS depends on both and varies by tens of MiB between identical runs.
    ``peak`` is None where ``mallinfo2`` is unavailable (non-glibc, glibc < 2.33).
    With ``record=True`` every sample is kept as ``(perf_counter seconds, bytes in use,
    resident bytes)`` in ``samples`` (the memory timeline; resident: ``/proc/self/statm``,
    None where unreadable).
    """

    def __init__(self, interval: float = 0.0005, record: bool = False) -> None:
        import threading

        self.interval = interval
        self.peak: int | None = None
        self.samples: list[tuple[float, int, int | None]] | None = [] if record else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mallinfo = _load_mallinfo()
        self._statm: int | None = None
        if record:
            import os

            try:
                self._statm = os.open("/proc/self/statm", os.O_RDONLY)
                self._page = os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError):
                self._statm = None

    def _rss(self) -> int | None:
        if self._statm is None:
            return None
        import os

        return int(os.pread(self._statm, 128, 0).split()[1]) * self._page

    def _in_use(self) -> int:
        info = self._mallinfo()
        return info.uordblks + info.hblkhd

    @property
    def available(self) -> bool:
        return self._mallinfo is not None

    def sample(self) -> None:
        """Take one sample now (from any thread)."""
        now = self._in_use()
        self.peak = max(self.peak or 0, now)
        if self.samples is not None:
            self.samples.append((time.perf_counter(), now, self._rss()))

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> HeapPeak:
        if self._mallinfo is not None:
            import threading

            self.sample()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.sample()
        if self._statm is not None:
            import os

            os.close(self._statm)
            self._statm = None


# -- live state ------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def live_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (local tensors).

    ``*_bytes`` sum the local tensors' logical sizes (no padding); ``storage_bytes``
    sums the distinct storages behind them (padding and flat buffers included).
    """
    params = grads = optim = 0
    storages: dict[int, int] = {}

    def visit(t: torch.Tensor) -> int:
        loc = _local(t)
        if loc.device.type != "meta":
            st = loc.untyped_storage()
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
        return loc.numel() * loc.element_size()

    for p in model.parameters():
        params += visit(p)
        if p.grad is not None:
            grads += visit(p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                optim += visit(v)
    return {
        "param_bytes": params,
        "grad_bytes": grads,
        "optim_bytes": optim,
        "live_bytes": params + grads + optim,
        "storage_bytes": sum(storages.values()),
    }


def hyperfsdp_padding_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Padding hyperfsdp allocated on this rank, from ``sharding_plan()`` rows."""
    rows = model.sharding_plan()
    pad = 0
    padded_params = 0
    for row in rows:
        extra = math.prod(row.padded_shape) - math.prod(row.local_shape)
        if extra:
            padded_params += 1
            pad += extra * torch.empty((), dtype=row.orig_dtype).element_size()
    return {"padding_bytes": pad, "padded_params": padded_params, "n_managed": len(rows)}


def fsdp2_padding_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Padding FSDP2 allocated on this rank (its FSDPParams' padded sharded sizes; private API)."""
    pad = 0
    padded_params = 0
    n = 0
    seen: set[int] = set()
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            if id(group) in seen:
                continue
            seen.add(id(group))
            for fp in group.fsdp_params:
                n += 1
                extra = fp.padded_sharded_param_size.numel() - fp.sharded_size.numel()
                if extra:
                    padded_params += 1
                    pad += extra * fp._sharded_param_data.element_size()
    return {"padding_bytes": pad, "padded_params": padded_params, "n_managed": n}


# -- copies and allocations ------------------------------------------------------------------------

#: ops that copy tensor data (their written bytes are counted by :class:`CopyCounter`):
#: torch's own and FSDP2's (``fsdp::all_gather_copy_in``: the copy-in of the all-gather
#: input; ``fsdp::split_with_sizes_copy``: the copy-out; ``fsdp::chunk_cat``: the
#: reduce-scatter input's pack)
COPY_OPS = frozenset(
    {
        "aten::copy_",
        "aten::_to_copy",
        "aten::clone",
        "aten::cat",
        "aten::stack",
        "aten::split_with_sizes_copy",
        "aten::_chunk_cat",
        "aten::_foreach_copy_",
        "aten::_foreach_copy",
        "aten::narrow_copy",
        "aten::index_copy",
        "aten::index_copy_",
        "aten::constant_pad_nd",
        "fsdp::all_gather_copy_in",
        "fsdp::split_with_sizes_copy",
        "fsdp::chunk_cat",
    }
)


def _local_nbytes(x) -> int:
    """Bytes of a tensor (a DTensor's local shard), or of a list of them."""
    if isinstance(x, (list, tuple)):
        return sum(_local_nbytes(t) for t in x)
    if not isinstance(x, torch.Tensor):
        return 0
    local = getattr(x, "_local_tensor", None)
    t = local if isinstance(local, torch.Tensor) else x
    return t.numel() * t.element_size()


def _copied_bytes(func, args, kwargs, out) -> int:
    """Bytes one copy op writes: its mutated arguments (``copy_``'s destination, ``out=``),
    else its outputs; ``fsdp::all_gather_copy_in``: the input slot it fills."""
    schema = func._schema
    if schema.name == "fsdp::all_gather_copy_in":
        return int(args[3]) * args[1].element_size()
    written = 0
    mutated = False
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        mutated = True
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        written += _local_nbytes(value)
    return written if mutated else _local_nbytes(out)


def copy_counter():
    """A :class:`CopyCounter` (built on first use: the dispatch-mode import costs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CopyCounter(TorchDispatchMode):
        """Bytes written by copy ops (:data:`COPY_OPS`) on this thread while active, by op.

        Seen at the top of the dispatcher, before any tensor subclass: an op on a DTensor
        counts its local shard once (the local op DTensor runs is not seen again), and an
        FSDP2 custom op counts as itself, not as the copies inside it. Copies inside a
        collective's C++ implementation (gloo's own buffers) are not dispatched, so not
        counted, for either FSDP.
        """

        def __init__(self) -> None:
            super().__init__()
            self.bytes: dict[str, int] = defaultdict(int)
            self.calls: dict[str, int] = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func._schema.name
            if name in COPY_OPS:
                self.calls[name] += 1
                self.bytes[name] += _copied_bytes(func, args, kwargs, out)
            return out

    return CopyCounter()


def count_copies_and_allocations(step) -> dict:
    """Run ``step()`` once with its copies counted (:func:`copy_counter`) and its allocations
    recorded (the profiler's memory events: every allocation of torch's CPU allocator on
    the threads the profiler follows, the training thread and autograd's; gloo's worker
    threads are not followed, for either FSDP)."""
    from torch.profiler import ProfilerActivity, profile

    counter = copy_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, counter:
        step()
    allocs = alloc_bytes = 0
    for event in prof.profiler.kineto_results.events():
        if event.name() == "[memory]" and event.nbytes() > 0:
            allocs += 1
            alloc_bytes += event.nbytes()
    return {
        "copy_bytes": sum(counter.bytes.values()),
        "copy_calls": sum(counter.calls.values()),
        "copy_bytes_by_op": dict(sorted(counter.bytes.items())),
        "copy_calls_by_op": dict(sorted(counter.calls.items())),
        "allocs": allocs,
        "alloc_bytes": alloc_bytes,
    }
