"""Collectives on CPU (async work handles) and accelerators (side streams + events).

The rest of the core calls :class:`Comm`: it issues one collective and returns a
:class:`Handle` whose ``wait()`` makes the result usable by the caller's compute.
On CPU the gloo worker threads communicate while the training thread computes;
on accelerators collectives run on dedicated streams ordered by events (no
``record_stream``: buffers stay referenced by their handle until waited).
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_reduce = dist.all_reduce


@attrs.define
class CommStats:
    """Counts of collectives issued through one :class:`Comm` (for tests and benchmarks)."""

    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0
    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_reduce_bytes: int = 0

    def reset(self) -> None:
        for field in attrs.fields(CommStats):
            setattr(self, field.name, 0)

    def snapshot(self) -> dict[str, int]:
        return attrs.asdict(self)


class Handle:
    """A pending collective. ``wait()`` is idempotent.

    On CPU it wraps a work handle (``wait()`` blocks until gloo is done); on an
    accelerator an event recorded on the communication stream (``wait()`` makes the
    current stream wait for it, without blocking the host).
    """

    __slots__ = ("_done", "_event", "_module", "_work", "keepalive")

    def __init__(self, work=None, event=None, keepalive=None, module=None) -> None:
        self._work = work
        self._event = event
        self._module = module
        self._done = work is None and event is None
        self.keepalive = keepalive

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._event is not None:
            self._module.current_stream().wait_event(self._event)
        self._done = True
        self._work = self._event = None
        self.keepalive = None

    def abandon(self) -> None:
        """Wait, ignoring errors (used when recovering from a failed iteration)."""
        try:
            self.wait()
        except Exception:
            self._done = True
            self._work = self._event = self.keepalive = None


class BufferPool:
    """Reuses communication buffers instead of reallocating them every time (CPU only).

    Keeps idle buffers of one size class (numel, dtype) per use: a run of units of the
    same size (transformer blocks) passes the same buffers along, and a buffer of
    another size (the root's) is freed as soon as a different size is asked for, so it
    does not sit idle through the rest of the pass. Accelerators' caching allocators
    already reuse memory, so they get no pool.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._key: tuple[int, torch.dtype] | None = None
        self._free: list[torch.Tensor] = []

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (numel, dtype)
        if key != self._key:
            self._key = key
            self._free = []
        if self._free:
            return self._free.pop()
        return torch.empty(numel, dtype=dtype, device=self.device)

    def put(self, tensor: torch.Tensor) -> None:
        if (tensor.numel(), tensor.dtype) == self._key:
            self._free.append(tensor)

    def clear(self) -> None:
        self._free = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._free)


class Comm:
    """Issues collectives for one root (or several roots sharing it via ``share_comm_ctx``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stats = CommStats()
        self.is_cpu = device.type == "cpu"
        # one pool per use: all-gather outputs and reduce-scatter inputs
        self.pools = (
            {"gather": BufferPool(device), "reduce": BufferPool(device)} if self.is_cpu else None
        )
        self.all_gather_stream = self.reduce_stream = None
        if not self.is_cpu:
            self._module = torch.get_device_module(device.type)
            self.all_gather_stream = self._module.Stream(device=device)
            self.reduce_stream = self._module.Stream(device=device)

    # -- buffers -------------------------------------------------------------------------
    def buffer(self, numel: int, dtype: torch.dtype, use: str, custom=None) -> torch.Tensor:
        """A communication buffer for ``use`` (``"gather"`` or ``"reduce"``).

        ``custom.allocate`` decides where it lives if given (FSDP2-style custom comms).
        """
        if custom is not None:
            return custom.allocate((numel,), dtype=dtype, device=self.device)
        if self.pools is not None:
            return self.pools[use].get(numel, dtype)
        return torch.empty(numel, dtype=dtype, device=self.device)

    def recycle(self, tensor: torch.Tensor | None, use: str, custom=None) -> None:
        if self.pools is not None and tensor is not None and custom is None:
            self.pools[use].put(tensor)

    def trim(self) -> None:
        """Free every idle pooled buffer."""
        if self.pools is not None:
            for pool in self.pools.values():
                pool.clear()

    @property
    def pooled_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values()) if self.pools is not None else 0

    # -- collectives ---------------------------------------------------------------------
    # ``custom`` is an FSDP2-style comm object (``set_custom_all_gather`` /
    # ``set_custom_reduce_scatter``): ``custom(output, input, group, [op,] async_op=...)``.
    # The module-level ``_all_gather`` etc. are looked up at call time (tests count them).
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group, custom=None) -> Handle:
        self.stats.all_gathers += 1
        self.stats.all_gather_bytes += out.numel() * out.element_size()
        if custom is not None:
            call = lambda: custom(out, inp, group, async_op=self.is_cpu)  # noqa: E731
        else:
            call = lambda: _all_gather(out, inp, group=group, async_op=self.is_cpu)  # noqa: E731
        return self._issue(self.all_gather_stream, call, (out, inp))

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, group, op, custom=None
    ) -> Handle:
        self.stats.reduce_scatters += 1
        self.stats.reduce_scatter_bytes += inp.numel() * inp.element_size()
        if custom is not None:
            call = lambda: custom(out, inp, group, op, async_op=self.is_cpu)  # noqa: E731
        else:
            call = lambda: _reduce_scatter(out, inp, op=op, group=group, async_op=self.is_cpu)  # noqa: E731
        return self._issue(self.reduce_stream, call, (out, inp))

    def all_reduce(self, tensor: torch.Tensor, group, op) -> Handle:
        self.stats.all_reduces += 1
        self.stats.all_reduce_bytes += tensor.numel() * tensor.element_size()
        call = lambda: _all_reduce(tensor, op=op, group=group, async_op=self.is_cpu)  # noqa: E731
        return self._issue(self.reduce_stream, call, (tensor,))

    def _issue(self, stream, call, keepalive) -> Handle:
        """Run one collective: async on CPU (a work handle, or none if it finished in
        place), on ``stream`` ordered after the current stream on accelerators."""
        if self.is_cpu:
            work = call()
            return Handle(work, keepalive=keepalive) if work is not None else Handle()
        stream.wait_stream(self._module.current_stream())
        with self._module.stream(stream):
            call()
            event = stream.record_event()
        return Handle(event=event, keepalive=keepalive, module=self._module)

    def current_stream(self):
        return self._module.current_stream()
