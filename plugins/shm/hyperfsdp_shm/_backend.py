"""``hyperfsdp_shm``: a c10d backend for CPU ranks on one host whose all-gathers and
sum-reduce-scatters go through shared memory (``_shm.py``) and everything else through
gloo.

The plugin's transport already gathers and reduce-scatters hyperfsdp's buckets this way
on gloo groups.
Collectives the core does not issue (tensor parallelism's sequence-parallel all-gathers
and reduce-scatters, which DTensor runs through the functional collectives, or a user's
own ``dist.all_gather_into_tensor``) run on the group's backend; naming this one for a
mesh dimension (``init_device_mesh(..., backend_override={"tp": "hyperfsdp_shm"})``)
moves them off gloo's sockets too. Results are gloo's bit for bit: all-gathers copy
bytes, and reduce-scatters add in gloo's order (``ShmGroup.reduce_scatter``); where the
transport cannot match gloo (another reduction, or a group of more than two whose ring
order did not check out), or cannot be set up at all, gloo runs the collective.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from . import _shm
from ._settings import use_shm
from ._torch_private import PythonProcessGroup

#: the backend's name, for ``init_process_group``, ``new_group`` and ``init_device_mesh``
BACKEND = "hyperfsdp_shm"
_UNSET = object()


class _Done(dist.Work):
    """The handle of a collective that was complete when issued (shared memory)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._tensors = tensors

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._tensors)
        return future


class ShmProcessGroup(PythonProcessGroup):
    """The process group ``hyperfsdp_shm`` creates: gloo for the same ranks, except that
    all-gathers and sum-reduce-scatters (single and coalesced, as ``dist`` and the
    functional collectives issue them) go through the group's shared-memory transport.

    The transport is made at the group's first all-gather or reduce-scatter, which every
    member reaches at the same point (making it is collective, over gloo); where some
    member cannot map the others' memory, or ``HYPERFSDP_SHM=0``, the group is gloo.
    """

    def __init__(self, store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size, dist.ProcessGroupGloo(store, rank, size, timeout))
        self.timeout = timeout
        self._transport = _UNSET

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"ShmProcessGroup(rank={self.rank()}, size={self.size()})"

    @property
    def transport(self) -> _shm.ShmGroup | None:
        """The shared-memory transport, made at first use (collective), or None."""
        if self._transport is _UNSET:
            # None while it is made: the collectives that make it (and check its order of
            # additions against gloo's) run on gloo
            self._transport = None
            if use_shm() and self.size() > 1:
                self._transport = _shm.ShmGroup.create(self, self.rank(), self.size(), self.timeout)
        return self._transport  # type: ignore[return-value]

    @property
    def made_transport(self) -> _shm.ShmGroup | None:
        """The transport if it has been made (never makes it: that is collective)."""
        return None if self._transport is _UNSET else self._transport  # type: ignore[return-value]

    # -- all-gathers and reduce-scatters ------------------------------------------------
    def _takes(self, out: torch.Tensor, inp: torch.Tensor, opts, gather: bool) -> bool:
        """Whether the transport takes this all-gather (``gather``) or reduce-scatter: a
        sum, which it adds in gloo's order. Otherwise gloo runs it (and raises gloo's
        error on a mismatch)."""
        whole, part = (out, inp) if gather else (inp, out)
        if not (
            out.device.type == inp.device.type == "cpu"
            and out.dtype == inp.dtype
            and whole.numel() == part.numel() * self.size()
        ):
            return False
        if not gather and (
            (opts is not None and opts.reduceOp != dist.ReduceOp.SUM) or out.dtype == torch.bool
        ):
            return False
        transport = self.transport
        return transport is not None and (gather or transport.ring_order)

    def _run(self, outs, inps, opts, gather: bool) -> dist.Work:
        """All-gather (``gather``) or sum-reduce-scatter each ``inps[i]`` into ``outs[i]``:
        through the transport where it takes every pair, else through gloo."""
        pairs = list(zip(outs, inps, strict=True))
        if not all(self._takes(o, i, opts, gather) for o, i in pairs):
            # gloo's own (the base class runs these on the backend)
            if gather:
                base, opts = PythonProcessGroup.all_gather_single, opts or dist.AllgatherOptions()
            else:
                base = PythonProcessGroup.reduce_scatter_single
                opts = opts or dist.ReduceScatterOptions()
            if len(pairs) == 1:
                return base(self, outs[0], inps[0], opts)
            for o, i in pairs:
                base(self, o, i, opts).wait()
            return _Done(list(outs))
        transport = self._transport
        move = transport.all_gather if gather else transport.reduce_scatter  # type: ignore[union-attr]
        for out, inp in pairs:
            inp = inp.contiguous().view(-1)
            if out.is_contiguous() and not self._aliased(out, inp, gather):
                move(out.view(-1), inp)
                continue
            flat = torch.empty(out.numel(), dtype=out.dtype)
            move(flat, inp)
            out.copy_(flat.view(out.shape))
        return _Done(list(outs))

    def _aliased(self, out: torch.Tensor, inp: torch.Tensor, gather: bool) -> bool:
        """Whether ``inp`` shares ``out``'s memory in a way the transport cannot take in
        place: a reduce-scatter writes partial sums into ``out`` while it still reads this
        rank's part of ``inp``; an all-gather takes only an input that is exactly this
        rank's row of the output."""
        if out.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr():
            return False
        if not gather:
            return True
        row = out.view(self.size(), -1)[self.rank()]
        return not (row.data_ptr() == inp.data_ptr() and row.numel() == inp.numel())

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts=None) -> dist.Work:
        return self._run([out], [inp], opts, gather=True)

    def all_gather_single_coalesced(self, outs, inps, opts=None) -> dist.Work:
        return self._run(outs, inps, opts, gather=True)

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, opts=None) -> dist.Work:
        return self._run([out], [inp], opts, gather=False)

    def reduce_scatter_single_coalesced(self, outs, inps, opts=None) -> dist.Work:
        return self._run(outs, inps, opts, gather=False)


def _create(store, rank: int, size: int, timeout: timedelta) -> ShmProcessGroup:
    return ShmProcessGroup(store, rank, size, timeout)


def register_shm_backend() -> str:
    """Register the ``hyperfsdp_shm`` c10d backend (once per process; later calls do
    nothing) and return its name.

    Name it wherever c10d takes a backend: for one mesh dimension
    (``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"),
    backend_override={"tp": "hyperfsdp_shm"})``), a group (``new_group(ranks,
    backend="hyperfsdp_shm")``) or every group (``init_process_group("hyperfsdp_shm")``).
    Its groups are gloo groups whose all-gathers and sum-reduce-scatters go through
    shared memory when all members are on one host, with gloo's results bit for bit.
    """
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    return BACKEND
