"""The offload plugin: ``offload_policy=CPUOffloadPolicy(pin_memory)`` on any host.

Where things live for a unit sharded with ``CPUOffloadPolicy``:

- **Sharded parameters** (the flat sharded storage, padding included, and the DTensors'
  local shards inside it) live on the host, pinned when the unit computes on an
  accelerator and ``pin_memory`` is set (``hyperfsdp_sharded_storage``). Before each
  all-gather the storage is copied host-to-device into the all-gather input, on the core's
  all-gather stream (``hyperfsdp_all_gather_input``): one non-blocking copy from pinned
  memory in the storage's dtype, then, under mixed precision, the cast on the device.
  Unsharded parameters stay on the compute device and are freed as
  ``reshard_after_forward`` says.
- **Reduced gradients** land on the host (``hyperfsdp_grad_landing``). The core lands a
  reduction when its last hold is released, i.e. after every data-parallel
  (``dp.all_reduce``) and tensor-parallel (``tp.replicate_all_reduce``) reduction of it, so
  the device-side reduced gradient stays on the device until then (RFC section 6.2). Each
  landing casts to the parameter's dtype on the device and copies device-to-host on this
  plugin's copy stream into pinned memory, recording an event; the device tensor is kept
  alive until its event completes.
- The ``offload.grads_to_host`` phase, after both reductions, waits for every copy, so the
  optimizer reads complete host gradients and creates its state on the host.
- Accumulating into an existing host gradient (several backwards before a step) waits for
  the copies in flight and copies synchronously: the host adds right away.
  With ``set_requires_gradient_sync(False)`` the unsharded gradient accumulates on the
  compute device, as in FSDP2; the reduced result lands on the host once sync is back on.

On a host without an accelerator the unit computes on the CPU: the storage already is on
the compute device, copies are no-ops and pinning is skipped (one log line per process).
Setting ``HYPERFSDP_OFFLOAD_SIMULATE_ASYNC=1`` there (before the root's first forward) runs
the accelerator's copy paths instead (the all-gather input filled by a copy, gradients
landed through the copy engine) with simulated asynchronous gradient copies: each completes
only when the plugin waits for it, and reads as NaN before that, so a missing wait shows up
as wrong values in CPU tests. Written against ``hyperfsdp_core.plugin`` only.
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Any

import torch

from hyperfsdp_core import CPUOffloadPolicy
from hyperfsdp_core.plugin import (
    FIRST_PHASE,
    ParamView,
    Phase,
    RootView,
    ShardedStorage,
    StashKey,
    UnitSpec,
    UnitView,
    hookimpl,
    mesh_device,
)

HYPERFSDP_API = ">=1.0,<2"
PHASE = "offload.grads_to_host"
#: Set (to a non-empty value) on a CPU-only host to simulate asynchronous gradient copies.
SIMULATE_ENV = "HYPERFSDP_OFFLOAD_SIMULATE_ASYNC"
HOST = torch.device("cpu")

logger = logging.getLogger("hyperfsdp_offload")
_pin_notice_logged = False


def _notice_no_pinning(device: torch.device) -> None:
    """Say once per process that ``pin_memory=True`` has nothing to pin."""
    global _pin_notice_logged
    if _pin_notice_logged:
        return
    _pin_notice_logged = True
    logger.warning(
        "hyperfsdp-offload: CPUOffloadPolicy(pin_memory=True) with compute device %r: the "
        "sharded storage already is on the compute device, so pinning is skipped and "
        "host-device copies are no-ops (logged once per process)",
        str(device),
    )


# -- where the sharded storage lives ----------------------------------------------------------------


@hookimpl
def hyperfsdp_sharded_storage(unit: UnitSpec) -> ShardedStorage | None:
    policy = unit.offload_policy
    if not isinstance(policy, CPUOffloadPolicy):
        return None
    device = mesh_device(unit.mesh)
    pin = policy.pin_memory and device.type != "cpu"
    if policy.pin_memory and not pin:
        _notice_no_pinning(device)
    return ShardedStorage(HOST, pin_memory=pin)


def _simulating(unit: UnitView) -> bool:
    return unit.device.type == "cpu" and bool(os.environ.get(SIMULATE_ENV))


def _copies_needed(unit: UnitView) -> bool:
    """The unit is offloaded and computes elsewhere (or simulates doing so)."""
    if not isinstance(unit.offload_policy, CPUOffloadPolicy) or not unit.params:
        return False
    return unit.device.type != "cpu" or _simulating(unit)


# -- host-to-device copies before the all-gather ------------------------------------------------------


def _host_to_device(sharded: torch.Tensor, dest: torch.Tensor) -> None:
    """Fill the all-gather input ``dest`` (compute device, compute dtype) from the host
    storage. Runs on the all-gather stream: the copy overlaps the current compute.

    The copy moves the storage's own dtype, asynchronously from pinned memory; a cast
    follows on the device. (A single cross-device ``copy_`` that also casts may convert on
    the host first, depending on the torch version: a synchronous pass over host memory.)
    The staging buffer is allocated on the all-gather stream, so the caching allocator
    hands its memory only to later work of that stream once it is freed.
    """
    if sharded.dtype == dest.dtype:
        dest.copy_(sharded, non_blocking=True)
        return
    staged = torch.empty(sharded.shape, dtype=sharded.dtype, device=dest.device)
    staged.copy_(sharded, non_blocking=True)
    dest.copy_(staged)


@hookimpl
def hyperfsdp_all_gather_input(unit: UnitView):
    return _host_to_device if _copies_needed(unit) else None


# -- device-to-host gradient copies ------------------------------------------------------------------


class _DeviceToHost:
    """One root's device-to-host gradient copies on an accelerator.

    Asynchronous copies run on a copy stream of their own, ordered after the work queued
    on the current stream (the reduction that produced the gradient), into pinned host
    memory, so they overlap the rest of the backward. The device tensor read by a copy is
    kept alive until the copy's event completes (no ``record_stream``): the caching
    allocator could otherwise hand its memory to a kernel of the current stream while the
    copy still reads it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = torch.get_device_module(device)
        self.stream = self._module.Stream(device=device)
        #: (event, device tensors the copy stream reads), oldest first: one stream, in order
        self.pending: collections.deque[tuple[Any, tuple]] = collections.deque()

    def copy_async(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        self._trim()
        self.stream.wait_stream(self._module.current_stream(self.device))
        with self._module.stream(self.stream):
            src = shard.to(dtype)  # cast on the device, before the copy
            host = torch.empty(src.shape, dtype=dtype, device=HOST, pin_memory=True)
            host.copy_(src, non_blocking=True)
            event = self.stream.record_event()
        self.pending.append((event, (shard, src)))  # the cast reads shard on this stream too
        return host

    def copy_now(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A copy that is complete on return (on the current stream)."""
        return shard.to(dtype).to(HOST)

    def wait(self) -> None:
        """Block until every copy issued so far is complete."""
        if self.pending:
            self.pending[-1][0].synchronize()
            self.pending.clear()

    def _trim(self) -> None:
        pending = self.pending
        while pending and pending[0][0].query():
            pending.popleft()

    def reset(self) -> None:
        """After a failed iteration: nothing may stay in flight (the memory is reused)."""
        try:
            self.wait()
        finally:
            self.pending.clear()


class _SimulatedDeviceToHost:
    """The same protocol on a CPU-only host, with copies that complete only when waited for.

    An asynchronous copy returns a host tensor filled with NaN; the copy itself happens in
    :meth:`wait`, reading the source as it is then (as a device copy reads its source
    whenever the copy engine gets to it). Code that reads a gradient before waiting for
    its copy, or that lets the source change, gets wrong values.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy_async(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        src = shard.to(dtype)
        host = torch.empty_like(src)
        if host.is_floating_point():
            host.fill_(float("nan"))
        self.pending.append((host, src))
        return host

    def copy_now(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return shard.to(dtype, copy=True)

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        for host, src in pending:
            host.copy_(src)

    def reset(self) -> None:
        self.wait()  # as on a device: copies already issued complete


_COPIES = StashKey[Any]("offload.device_to_host")
#: marks the parameters of offloaded units (for ``sharding_plan()``)
_OFFLOADED = StashKey[bool]("offload.offloaded")


def _copies_of(root: RootView, device: torch.device, simulate: bool):
    def make():
        return _SimulatedDeviceToHost() if simulate else _DeviceToHost(device)

    return root.stash.setdefault(_COPIES, make)


@hookimpl
def hyperfsdp_grad_landing(unit: UnitView):
    policy = unit.offload_policy
    if not isinstance(policy, CPUOffloadPolicy):
        return None
    for p in unit.params:
        p.stash[_OFFLOADED] = True
    if not _copies_needed(unit):
        return None  # the gradient already is on the host: nothing to copy
    root = unit.root
    assert root is not None, "grad landing is resolved at the root's lazy init"
    copies = _copies_of(root, unit.device, _simulating(unit))
    asynchronous = policy.pin_memory  # pageable memory cannot be copied asynchronously

    def land(param: ParamView, shard: torch.Tensor) -> torch.Tensor:
        dtype = param.orig_dtype
        if param.sharded_param.grad is not None:
            # The host adds into the existing gradient as soon as this returns: that
            # gradient's own copy and this one must be complete.
            copies.wait()
            return copies.copy_now(shard, dtype)
        if asynchronous:
            return copies.copy_async(shard, dtype)
        return copies.copy_now(shard, dtype)

    return land


def _grads_to_host(root: RootView) -> None:
    # Before the optimizer step (the last backward) every copy must be complete. After a
    # backward that is not the last, waiting is work safe to defer: the next landing on a
    # gradient waits for its copy before adding into it, and the last backward waits here.
    copies = root.stash.get(_COPIES, None)
    if copies is not None and root.is_last_backward:
        copies.wait()


@hookimpl
def hyperfsdp_finalize_phases():
    return [
        Phase(
            PHASE,
            _grads_to_host,
            after=(FIRST_PHASE,),
            after_if_present=("dp.all_reduce", "tp.replicate_all_reduce"),
        )
    ]


# -- inspection -------------------------------------------------------------------------------------
# State dicts need no hook: parameters are written on the host only (by the optimizer and
# by loading), never by an asynchronous copy; the core rebuilds the storage where
# hyperfsdp_sharded_storage says after load_state_dict, module.to() and to_empty().


@hookimpl
def hyperfsdp_plan_columns(param: ParamView):
    if not param.stash.get(_OFFLOADED, False):
        return None
    local = param.sharded_param.to_local()
    return {"storage": "host, pinned" if local.is_pinned() else "host"}
