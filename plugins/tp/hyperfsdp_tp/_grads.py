"""Gradients of tensor-parallel parameters: plain tensors inside the engine, one root-tail
all-reduce over the TP group for TP-replicated parameters.

What autograd leaves on an unsharded TP parameter is a DTensor on the TP mesh whose
placements say what its local tensor is:

* ``Shard(d)`` where the parameter is ``Shard(d)``: this rank's gradient shard, final;
* ``Replicate()`` where the parameter is ``Shard(d)`` (e.g. a row-wise embedding): the full
  gradient on every rank; this rank's chunk is taken locally (no communication);
* ``Partial(sum)`` where the parameter is ``Replicate()`` (norm weights under sequence
  parallelism, or any DTensor-to-DTensor chain): a partial sum; the TP ranks' values must be
  summed;
* ``Replicate()`` where the parameter is ``Replicate()`` (norms computed on replicated
  activations with local outputs): already the complete gradient on every TP rank; summing
  it over TP would count it TP times.

The engine reduces plain tensors: :class:`GradToLocal` turns the gradient into its local
tensor without any ``redistribute``. For TP-replicated parameters the local tensor is put in
*partial-sum form*: a ``Partial`` gradient is that already, a ``Replicate`` one is kept on TP
coordinate 0 and zeroed elsewhere (exact, no rounding). Sums commute with the data-parallel
reduce-scatter and all-reduce, so after those, one ``SUM`` all-reduce over the TP group per
step (:class:`TPReplicateGrads`, run in the ``tp.replicate_all_reduce`` finalization phase
after ``dp.all_reduce``) gives every rank the single-device gradient. Gradient scaling
(``1 / data-parallel size``) was applied once by the core before the first collective; the TP
all-reduce does not scale again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement, Shard

from hyperfsdp_core.plugin import ParamView, PluginComm, Reduction, UnitView, Work

from ._spec import TPSpec, tp_replicate_dim


class WrapUnsharded:
    """All-gathered plain tensor -> the DTensor the module computes with (no copy)."""

    __slots__ = ("mesh", "placements", "shape", "stride")

    def __init__(self, spec: TPSpec, shape: torch.Size, stride: tuple[int, ...]) -> None:
        self.mesh = spec.compute_mesh
        self.placements = spec.compute_placements
        self.shape = shape
        self.stride = stride

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


class GradToLocal:
    """Unsharded gradient DTensor -> plain local tensor of the TP-local shape (see module doc)."""

    __slots__ = ("coords", "expected", "fqn", "sizes", "tp_dims", "zero_replicated")

    def __init__(self, fqn: str, spec: TPSpec) -> None:
        self.fqn = fqn
        self.expected = spec.compute_placements
        self.tp_dims = spec.tp_dims
        mesh = spec.compute_mesh
        self.coords = {i: mesh.get_local_rank(i) for i in spec.tp_dims}
        self.sizes = {i: mesh.size(i) for i in spec.tp_dims}
        #: a Replicate() gradient of a TP-replicated parameter is zeroed on this rank
        self.zero_replicated = any(
            self.expected[i].is_replicate() and self.coords[i] != 0 for i in spec.tp_dims
        )

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, DTensor):
            raise TypeError(
                f"hyperfsdp-tp: the gradient of tensor-parallel parameter {self.fqn!r} is a "
                f"{type(grad).__name__}, expected a DTensor on the parameter's mesh"
            )
        local = grad.to_local()
        placements = grad.placements
        if placements == self.expected:  # the common case
            return torch.zeros_like(local) if self.zero_replicated else local
        if len(placements) != len(self.expected):
            raise self._unsupported(placements)
        zero = False
        for i in self.tp_dims:
            want, got = self.expected[i], placements[i]
            if want.is_replicate():
                if got.is_replicate():
                    zero = zero or self.coords[i] != 0
                elif not (got.is_partial() and getattr(got, "reduce_op", None) == "sum"):
                    raise self._unsupported(placements)
            elif got != want:
                if not (isinstance(want, Shard) and got.is_replicate()):
                    raise self._unsupported(placements)
                local = _chunk(local, want.dim, self.coords[i], self.sizes[i])
        return torch.zeros_like(local) if zero else local

    def _unsupported(self, placements: Sequence[Placement]) -> RuntimeError:
        return RuntimeError(
            f"hyperfsdp-tp: the gradient of {self.fqn!r} has placements {tuple(placements)}, "
            f"the parameter {self.expected}; turning it into this rank's local gradient would "
            "need a collective, which the engine does not run inside backward. Make the module "
            "produce gradients with the parameter's placements (or Partial(sum) for replicated "
            "parameters)"
        )


def _chunk(full: torch.Tensor, dim: int, coord: int, size: int) -> torch.Tensor:
    """This coordinate's ``Shard(dim)`` chunk of a replicated tensor (``torch.chunk`` sizes)."""
    n = full.shape[dim]
    chunk = math.ceil(n / size)
    start = min(coord * chunk, n)
    return full.narrow(dim, start, max(0, min(n - start, chunk)))


# -- the root-tail TP all-reduce -----------------------------------------------------------------

#: a TP-replicated parameter's TP group and its ranks (one all-reduce per rank set and dtype)
_Group = tuple[dist.ProcessGroup, tuple[int, ...]]


class TPReplicateGrads:
    """One root's reductions of TP-replicated gradients, held until the TP all-reduce phase."""

    def __init__(self, comm: PluginComm) -> None:
        self.comm = comm
        self.held: list[tuple[Reduction, list[tuple[ParamView, _Group]]]] = []

    def hold(self, red: Reduction, members: list[tuple[ParamView, _Group]]) -> None:
        red.defer()
        self.held.append((red, members))

    def all_reduce(self, unit_fqn: str) -> None:
        """Sum every held TP-replicated gradient shard over its TP group, then let them land.

        One all-reduce per (TP group, dtype, device) for the whole step. A reduction another
        plugin still holds has not finished its data-parallel reduction (the hsdp plugin
        keeps partial sums while ``set_requires_all_reduce(False)``): it stays held here until
        that plugin releases it (then it is summed over TP and lands) or consumes it into a
        later reduction (then that one is summed over TP, and this one is dropped).
        """
        held, self.held = self.held, []
        ready = []
        buckets: dict[tuple, tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
        for red, members in held:
            if red.consumed:
                red.release()
                continue
            if red.holds > 1:
                self.held.append((red, members))
                continue
            ready.append(red)
            for param, (group, ranks) in members:
                grad = red.grad_of(param)
                if grad is None or grad.numel() == 0:
                    continue
                buckets.setdefault((ranks, grad.dtype, grad.device), (group, []))[1].append(grad)
        works: list[tuple[Work, torch.Tensor, list[torch.Tensor]]] = []
        for group, grads in buckets.values():
            flat = grads[0] if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])
            works.append((self.comm.all_reduce(flat, group, unit=unit_fqn), flat, grads))
        for work, flat, grads in works:
            work.wait()
            if len(grads) > 1:
                for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
                    grad.copy_(part.view_as(grad))
        for red in ready:
            red.release()

    def reset(self) -> None:
        """A failed iteration: drop the held reductions (they never land)."""
        self.held = []


def make_reducer(unit: UnitView, key):
    """The unit's reducer: hold each reduction with TP-replicated members for the phase."""
    members: dict[ParamView, _Group] = {}
    for p in unit.params:
        dim = tp_replicate_dim(p)
        if dim is not None:
            group = p.device_mesh.get_group(dim)
            members[p] = (group, tuple(dist.get_process_group_ranks(group)))
    if not members:
        return None

    def reduce(reductions: Sequence[Reduction]) -> None:
        queue = None
        for red in reductions:
            if red.consumed:
                continue
            mine = [(p, members[p]) for p in red.params if p in members]
            if not mine:
                continue
            if queue is None:
                queue = _queue(unit, key)
            queue.hold(red, mine)

    return reduce


def _queue(unit: UnitView, key) -> TPReplicateGrads:
    root = unit.root
    assert root is not None
    return root.stash.setdefault(key, lambda: TPReplicateGrads(root.comm))
