"""The only place hyperfsdp touches private PyTorch APIs; each use says why.

Everything else is written against public APIs. If a use here breaks on a new
torch release, this module is the one to adapt.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current autograd backward pass has finished.

    The root unit must drain pending reductions after the last gradient of the
    backward is computed, whether or not every unit's inputs required grad.
    PyTorch offers no public end-of-backward hook; FSDP2 and DDP use this engine
    call for the same purpose.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def dtensor_from_local_fast(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor with ``like``'s mesh, placements and global shape around ``local``.

    Used once per parameter per step to hand sharded gradients to the optimizer.
    ``DTensor.from_local`` recomputes and validates the spec and goes through an
    autograd function each call; the spec of a gradient equals the parameter's,
    so reuse it directly (the constructor is documented as internal).
    """
    spec = like._spec
    if spec.tensor_meta is not None and spec.tensor_meta.dtype != local.dtype:
        return DTensor.from_local(
            local,
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )
    return DTensor(local, spec, requires_grad=False)


def dtensor_local_tensor(dt: DTensor) -> torch.Tensor:
    """``dt``'s own local tensor object (not a view of it).

    The all-gather extension calls ``fsdp_pre_all_gather``/``fsdp_post_all_gather`` on
    the sharded parameter's local tensor, whose attributes users set between steps
    (torchao's ``precompute_float8_dynamic_scale_for_fsdp`` sets ``_precomputed_scale``
    on ``weight._local_tensor``, as FSDP2 reads it). The public ``to_local()`` of a
    ``Parameter(DTensor)`` returns a fresh view in torch 2.13, a new subclass object
    without those attributes.
    """
    return dt._local_tensor


def swap_storage_memory(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory (and byte sizes) of two CPU storages.

    A bucket's unsharded buffer is freed on reshard and allocated again on unshard
    (``resize_``), keeping its storage object so that the unsharded parameters, and the
    references autograd saved to them, stay valid. On CPU a large allocation comes from
    fresh ``mmap`` pages each time, and faulting them in costs several times the
    gather itself. Parking the memory in a spare storage instead, and swapping it
    back at the next unshard of that size, keeps the storage object as ``resize_``
    does. PyTorch has no public call to move memory between storages.
    """
    a._swap_data_ptr_(b)  # type: ignore[attr-defined]


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` (``CommDebugMode``, ``FakeTensorMode``, a tracer) is
    active on this thread.

    Such a mode sees collectives only as the c10d ops ``torch.distributed`` dispatches;
    the core's shared-memory and point-to-point stand-ins are invisible to it (or look
    like other collectives), so while one is active the core takes ``torch.distributed``'s
    own route. torch has no public query of the mode stack; this one reads its length
    (about 0.1 us).
    """
    return torch._C._len_torch_dispatch_stack() > 0  # type: ignore[attr-defined]


def group_timeout(group) -> timedelta:
    """The timeout ``group``'s CPU backend was created with (``init_process_group(timeout=)``
    or ``new_group(timeout=)``), or torch's default where it cannot be read.

    The shared-memory collectives (``_shm.py``) wait on their peers themselves and give up
    after the same time gloo would. A process group's timeout is only readable through its
    backend's options, which are not public.
    """
    try:
        if group is None:
            group = dist.group.WORLD
        timeout = group._get_backend(torch.device("cpu")).options._timeout  # type: ignore[attr-defined]
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout
    except (AttributeError, RuntimeError):
        pass
    return dist.default_pg_timeout


def _forward(name: str, to: str | None = None):
    def method(self, *args, **kwargs):
        return getattr(self.backend, to or name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"Run on the backend (``{to or name}``), without the GIL."
    return method


class PythonProcessGroup(dist.ProcessGroup):
    """A c10d process group written in Python, which runs what it does not override on a
    C++ ``backend`` (gloo) for the same ranks.

    c10d lets a custom backend's creator return a ``ProcessGroup`` subclass, whose
    overridden collectives c10d, the functional collectives and DTensor then call. Three
    things about that are not public:

    - The group has no C++ backend for the collectives it leaves alone, so one is attached
      (``_register_backend``; c10d also reads the group's timeout from it).
    - A collective the subclass does not override is run by c10d's base class with the
      GIL held. Issuing a gloo collective then waits for gloo's queue while a gloo worker
      thread, freeing the tensors of the collective it has just finished, waits for the
      GIL: a deadlock (seen with DTensor's all-reduces). So every collective is
      overridden here, to call the backend's Python binding, which releases the GIL.
    - c10d names the group through ``_set_group_name``, which the ``group_name``
      property of a Python subclass does not read back, so the name is kept here.
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
