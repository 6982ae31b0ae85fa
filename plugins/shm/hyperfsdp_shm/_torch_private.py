"""The private torch APIs the shared-memory plugin relies on, each with the reason.

Everything else in ``hyperfsdp_shm`` is written against public APIs (torch's and
``hyperfsdp_core.plugin``). If a use here breaks on a new torch release, this module is
the one to adapt.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions
from torch.utils._python_dispatch import _disable_current_modes


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` (``CommDebugMode``, ``FlopCounterMode``, a tracer) is
    active on this thread. torch has no public query of the mode stack; this reads its
    length (one C++ call)."""
    return torch._C._len_torch_dispatch_stack() > 0  # type: ignore[attr-defined]


def modes_set_aside():
    """A ``with`` block that runs without this thread's dispatch modes (they are back
    after it): the shared-memory copies, the stand-ins' point-to-point and all-reduce
    calls and the setup of a shared-memory group are the transport's own workings, which
    a mode is shown as the one collective FSDP2 issues instead (:func:`show_all_gather`).
    ``_disable_current_modes`` is the only way to pop the mode stack and restore it."""
    if torch._C._len_torch_dispatch_stack() == 0:  # type: ignore[attr-defined]
        return nullcontext()
    return _disable_current_modes()


# torch 2.13 names the single-tensor methods of a ProcessGroup ``all_gather_single`` and
# ``reduce_scatter_single``; before, they were ``_allgather_base`` and ``_reduce_scatter_base``
_PG_ALL_GATHER = (
    getattr(dist.ProcessGroup, "all_gather_single", None) or dist.ProcessGroup._allgather_base
)
_PG_REDUCE_SCATTER = (
    getattr(dist.ProcessGroup, "reduce_scatter_single", None)
    or dist.ProcessGroup._reduce_scatter_base
)


def _process_group(group) -> dist.ProcessGroup:
    return dist.group.WORLD if group is None else group  # type: ignore[return-value]


def show_all_gather(numel: int, dtype: torch.dtype, group, async_op: bool) -> None:
    """Show this thread's dispatch modes an all-gather into ``numel`` elements of
    ``dtype`` over ``group`` as FSDP2 issues it (``c10d._allgather_base_``), moving no
    data: the op runs on meta tensors of those sizes, whose kernel (torch's
    ``_meta_registrations``) returns a finished fake work without communicating.

    c10d's own ``ProcessGroup`` method is called (not ``group``'s override, which a
    ``hyperfsdp_shm`` group has): it is what dispatches the op. The options classes are
    not exported by ``torch.distributed``.
    """
    group = _process_group(group)
    world = group.size()
    opts = AllgatherOptions()
    opts.asyncOp = async_op
    out = torch.empty(numel, dtype=dtype, device="meta")
    inp = torch.empty(numel // world, dtype=dtype, device="meta")
    _PG_ALL_GATHER(group, out, inp, opts)


def show_reduce_scatter(numel: int, dtype: torch.dtype, group, op, async_op: bool) -> None:
    """Like :func:`show_all_gather`, for a reduce-scatter of ``numel`` elements
    (``c10d._reduce_scatter_base_``) with reduction ``op``."""
    group = _process_group(group)
    world = group.size()
    opts = ReduceScatterOptions()
    opts.reduceOp = op
    opts.asyncOp = async_op
    inp = torch.empty(numel, dtype=dtype, device="meta")
    out = torch.empty(numel // world, dtype=dtype, device="meta")
    _PG_REDUCE_SCATTER(group, out, inp, opts)


def _forward(name: str, to: str | None = None):
    def method(self, *args, **kwargs):
        return getattr(self.backend, to or name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"Run on the backend (``{to or name}``), without the GIL."
    return method


class PythonProcessGroup(dist.ProcessGroup):
    """A c10d process group written in Python that runs what it does not override on a
    C++ ``backend`` (gloo) for the same ranks.

    c10d lets a custom backend's creator return a ``ProcessGroup`` subclass, whose
    overridden collectives c10d, the functional collectives and DTensor then call. Three
    things about that are not public:

    - The group has no C++ backend for the collectives it leaves alone, so one is attached
      (``_register_backend``; c10d also reads the group's timeout from it).
    - A collective the subclass does not override runs in c10d's base class with the GIL
      held; issuing a gloo collective then waits for gloo's queue while a gloo worker,
      freeing the tensors of the collective it just finished, waits for the GIL: a
      deadlock (seen with DTensor's all-reduces). So every collective is overridden here
      to call the backend's Python binding, which releases the GIL.
    - c10d names the group through ``_set_group_name``, which the ``group_name`` property
      of a Python subclass does not read back, so the name is kept here.
    """

    def __init__(self, rank: int, size: int, backend) -> None:
        super().__init__(rank, size)
        self.backend = backend
        self._c10d_name: str | None = None
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)  # type: ignore[attr-defined]

    def _set_group_name(self, name: str) -> None:
        self._c10d_name = name
        super()._set_group_name(name)  # type: ignore[misc]

    @property
    def group_name(self) -> str:
        if self._c10d_name is None:
            raise RuntimeError("ProcessGroup name not set")
        return self._c10d_name

    # every collective c10d's Python subclasses can override (but the four all-gathers and
    # reduce-scatters into one tensor, which subclasses take), on the backend
    allreduce = _forward("allreduce")
    allreduce_coalesced = _forward("allreduce_coalesced")
    allgather = _forward("allgather")
    allgather_coalesced = _forward("allgather_coalesced")
    alltoall = _forward("alltoall")
    all_to_all_single = _forward("all_to_all_single", "alltoall_base")
    barrier = _forward("barrier")
    broadcast = _forward("broadcast")
    gather = _forward("gather")
    scatter = _forward("scatter")
    reduce = _forward("reduce")
    reduce_scatter = _forward("reduce_scatter")
    send = _forward("send")
    recv = _forward("recv")
    recv_anysource = _forward("recv_anysource")
    all_gather_single = _forward("all_gather_single", "_allgather_base")
    reduce_scatter_single = _forward("reduce_scatter_single", "_reduce_scatter_base")

    if not hasattr(dist.ProcessGroup, "all_gather_single"):
        # Before torch 2.13, c10d calls a Python group's one-tensor all-gathers and
        # reduce-scatters by their older names: route those to the new ones, which the
        # subclasses override.
        def _allgather_base(self, out, inp, opts=None):
            return self.all_gather_single(out, inp, opts)

        def _reduce_scatter_base(self, out, inp, opts=None):
            return self.reduce_scatter_single(out, inp, opts)

        def allgather_into_tensor_coalesced(self, outs, inps, opts=None):
            return self.all_gather_single_coalesced(outs, inps, opts)

        def reduce_scatter_tensor_coalesced(self, outs, inps, opts=None):
            return self.reduce_scatter_single_coalesced(outs, inps, opts)

        def all_gather_single_coalesced(self, outs, inps, opts=None):
            return self.backend.allgather_into_tensor_coalesced(outs, inps, opts)

        def reduce_scatter_single_coalesced(self, outs, inps, opts=None):
            return self.backend.reduce_scatter_tensor_coalesced(outs, inps, opts)
