"""The only place the core touches private PyTorch names; each use says why.

Everything else in ``hyperfsdp_core`` is written against public APIs, and
``tests/test_layering.py`` fails on a private torch name anywhere else (a plugin keeps its
own ``_torch_private.py``; the built-in plugins theirs in ``plugin/builtin``). Differences
between the torch versions the core supports (2.11 to 2.13) live here too. If a use here
breaks on a new torch release, this module is the one to adapt.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions
from torch.distributed.tensor import DTensor

# the base class of the test harness's stream simulator (testing/streams.py): how a mode
# sees every operator; torch exports it only from this private module
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# torch has no public pytree module; a unit's forward inputs and outputs are walked with
# torch's own (as FSDP2 does) to cast them and to hook their tensors for the backward.
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "STORAGE_MEMORY_SWAPPABLE",
    "TorchDispatchMode",
    "dtensor_around",
    "dtensor_from_local_fast",
    "dtensor_local_tensor",
    "expose_fsdp2_state",
    "foreach_copy_",
    "foreach_zero_",
    "group_timeout",
    "modes_set_aside",
    "queue_end_of_backward_callback",
    "show_all_gather",
    "show_reduce_scatter",
    "shown_to_modes",
    "storage_id",
    "swap_storage_memory",
    "torch_fsdp_module_class",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
]


def foreach_copy_(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, in one multi-tensor kernel where the device has
    one. ``torch._foreach_copy_`` is what FSDP2 uses for its copy-in; its name is private."""
    torch._foreach_copy_(dsts, srcs)


def foreach_zero_(tensors: list[torch.Tensor]) -> None:
    """``t.zero_()`` for every tensor in one multi-tensor kernel (``torch._foreach_zero_``)."""
    torch._foreach_zero_(tensors)


def storage_id(t: torch.Tensor) -> int:
    """An identity of the storage behind ``t``, the same for every view of it, while that
    storage lives. ``data_ptr()`` is not one: every empty storage has address 0, and a freed
    (``resize_(0)``) storage keeps its identity but loses its address."""
    return t.untyped_storage()._cdata


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


def dtensor_around(
    local: torch.Tensor, mesh, placements: tuple, shape: torch.Size, stride: tuple[int, ...]
) -> DTensor:
    """A DTensor around ``local`` itself, on ``local``'s device.

    ``DTensor.from_local`` moves a local tensor whose device type differs from the mesh's
    to the mesh's device (``local.to(mesh.device_type)``): a CPU-offloaded shard of a CUDA
    mesh would silently land on the GPU, a copy rather than the bucket's host buffer.
    Where the device types agree (every case but offload) ``from_local`` is used; else the
    DTensor is built from its spec, as FSDP2 builds its sharded parameters.
    """
    if local.device.type == mesh.device_type or local.is_meta:
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
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


#: Whether storages can exchange their memory (:func:`swap_storage_memory`):
#: ``UntypedStorage._swap_data_ptr_`` is new in torch 2.13. On older torch the CPU pool
#: of parked unsharded memory is off and a reshard frees its buffer (``resize_(0)``), as
#: on accelerators; everything else is the same.
STORAGE_MEMORY_SWAPPABLE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


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


def group_timeout(group: dist.ProcessGroup | None) -> timedelta:
    """The timeout ``group`` (``None``: the default group) was created with
    (``init_process_group(timeout=)`` or ``new_group(timeout=)``), or torch's default
    (``torch.distributed.default_pg_timeout``) where it cannot be read.

    Public to plugins as ``hyperfsdp_core.plugin.group_timeout``, for those that bound
    their own waits by the job's process-group timeout (the shm plugin's collectives, the
    dcp plugin's checkpoint waits). torch has no public getter: the timeout is readable
    only through the options of the group's CPU backend.
    """
    try:
        if group is None:
            group = dist.group.WORLD
        timeout = group._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout
    except (AttributeError, RuntimeError, TypeError):
        pass
    return dist.default_pg_timeout


# -- what a torch dispatch mode sees of a collective the gloo routes carry ------------------
# (comm/gloo.py; plugins reach these through ``hyperfsdp_core.plugin``)


def shown_to_modes() -> bool:
    """Whether a ``TorchDispatchMode`` (``CommDebugMode``, ``FlopCounterMode``, a tracer) is
    active on this thread. torch has no public query of the mode stack; this reads its
    length (one C++ call)."""
    return torch._C._len_torch_dispatch_stack() > 0  # type: ignore[attr-defined]


def modes_set_aside():
    """A ``with`` block that runs without this thread's dispatch modes (they are back after
    it): a route's own copies, point-to-point and all-reduce calls, which a mode is shown as
    the one collective FSDP2 issues instead (:func:`show_all_gather`).
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


def show_all_gather(numel: int, dtype: torch.dtype, group, async_op: bool) -> None:
    """Show this thread's dispatch modes an all-gather into ``numel`` elements of ``dtype``
    over ``group`` as FSDP2 issues it (``c10d._allgather_base_``), moving no data: the op
    runs on meta tensors of those sizes, whose kernel (torch's ``_meta_registrations``)
    returns a finished fake work without communicating.

    c10d's own ``ProcessGroup`` method is called (not ``group``'s override, which a Python
    process group may have): it is what dispatches the op. The options classes are not
    exported by ``torch.distributed``.
    """
    group = dist.group.WORLD if group is None else group
    opts = AllgatherOptions()
    opts.asyncOp = async_op
    out = torch.empty(numel, dtype=dtype, device="meta")
    inp = torch.empty(numel // group.size(), dtype=dtype, device="meta")
    _PG_ALL_GATHER(group, out, inp, opts)


def show_reduce_scatter(numel: int, dtype: torch.dtype, group, op, async_op: bool) -> None:
    """Like :func:`show_all_gather`, for a reduce-scatter of ``numel`` elements
    (``c10d._reduce_scatter_base_``) with reduction ``op``."""
    group = dist.group.WORLD if group is None else group
    opts = ReduceScatterOptions()
    opts.reduceOp = op
    opts.asyncOp = async_op
    inp = torch.empty(numel, dtype=dtype, device="meta")
    out = torch.empty(numel // group.size(), dtype=dtype, device="meta")
    _PG_REDUCE_SCATTER(group, out, inp, opts)


#: torch's public FSDP2 names (the FSDP2 part of ``torch.distributed.fsdp.__all__``).
FSDP2_NAMES = (
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
)
#: The private modules that define them (torch 2.6+). ``use_as_fsdp2`` re-points the names
#: where code imports them from, never here, so torch's own objects can always be found.
_FSDP2_DEFINED_IN = (
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed.fsdp._fully_shard._fsdp_api",
)
#: Where code imports torch's FSDP2 names from: the public package, and two private aliases
#: that frameworks use (Lightning's ``ModelParallelStrategy`` imports ``FSDPModule`` from
#: ``torch.distributed._composable.fsdp``, the path of torch < 2.6).
_FSDP2_NAMESPACES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
)
#: torch's own modules that bind FSDP2 names when imported and rely on torch's objects:
#: the pipeline stage calls ``fully_shard.state(module)`` (see :func:`expose_fsdp2_state`).
_FSDP2_TORCH_USERS = ("torch.distributed.pipelining",)


@functools.cache
def torch_fsdp2_objects() -> dict[str, object]:
    """torch's own FSDP2 objects by public name (those the installed torch has), read from
    the modules that define them, which :func:`fsdp2_namespaces` does not include; empty
    where torch has no ``torch.distributed.fsdp``."""
    found: dict[str, object] = {}
    for module_name in _FSDP2_DEFINED_IN:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found.update({n: getattr(module, n) for n in FSDP2_NAMES if hasattr(module, n)})
    return found


def fsdp2_namespaces() -> list[types.ModuleType]:
    """The importable modules through which code reaches torch's FSDP2 names."""
    found = []
    for module_name in _FSDP2_NAMESPACES:
        try:
            found.append(importlib.import_module(module_name))
        except ImportError:
            continue
    return found


def bind_torch_fsdp2_users() -> None:
    """Import torch's own modules that bind FSDP2 names at import, so that they keep
    torch's objects when ``use_as_fsdp2`` re-points the public names afterwards."""
    for module_name in _FSDP2_TORCH_USERS:
        try:
            importlib.import_module(module_name)
        except ImportError:
            continue


def torch_fsdp_module_class() -> type | None:
    """torch's FSDP2 ``FSDPModule``, which hyperfsdp's unioned classes also subclass (as
    their last base, after ``nn.Module``: every attribute hyperfsdp, a plugin mixin or the
    original class defines wins) so that torch's pipelining (and torchtitan) recognise a
    hyperfsdp unit as FSDP. The class is public; that pipelining recognises FSDP by it is
    not documented. ``None`` where torch has no ``torch.distributed.fsdp``."""
    return torch_fsdp2_objects().get("FSDPModule")  # type: ignore[return-value]


def expose_fsdp2_state(module: torch.nn.Module, state: object) -> None:
    """Make ``torch.distributed.fsdp.fully_shard.state(module)`` return ``state``.

    torch's pipeline stage reads it at each step's gradient reduction (see above). The
    accessor looks the state up in ``module.__dict__[STATE_KEY]`` (``_composable.contract``)
    under the undecorated ``fully_shard`` function (``fully_shard.__wrapped__``, set by
    ``functools.wraps``); both are private. torch's own ``fully_shard``, also while
    ``use_as_fsdp2`` points the public name at hyperfsdp's.
    """
    try:
        from torch.distributed._composable.contract import STATE_KEY
    except ImportError:
        return
    key = getattr(torch_fsdp2_objects().get("fully_shard"), "__wrapped__", None)
    if key is None:
        return
    module.__dict__.setdefault(STATE_KEY, {})[key] = state
