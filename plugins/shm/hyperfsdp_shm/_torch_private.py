"""The private torch APIs the shared-memory plugin relies on, each with the reason.

Everything else in ``hyperfsdp_shm`` is written against public APIs (torch's and
``hyperfsdp_core.plugin``). If a use here breaks on a new torch release, this module is
the one to adapt.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
