"""The memory behind a bucket's unsharded parameters: the param-major flat buffer that
becomes their storage, who owns it (:class:`~.param.StorageOwner`), and its life per unshard:
allocated (parked memory of its size first), freed or parked at reshard.

:class:`UnshardedMemory` is this part of ``bucket.Bucket`` (its only subclass), kept apart so
each reads in one sitting; it uses the fields ``Bucket`` defines.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from .buffers import alias, free
from .param import StorageOwner


class UnshardedMemory:
    """The unsharded buffer of a bucket (see ``bucket.Bucket``)."""

    @property
    def storage_owner(self) -> StorageOwner:
        """Who will own the members' unsharded memory (the same for every member)."""
        if not self.needs_all_gather:
            return StorageOwner.CAST_BUFFER if self.needs_copy_in else StorageOwner.SHARDED_STORAGE
        if len(self.params) == 1 and self.params[0].shard_dim == 0:
            return StorageOwner.ALL_GATHER_OUTPUT
        return StorageOwner.FUSED_BUFFER

    def init_unsharded(self) -> None:
        """Create the stable unsharded Parameters (once per sharded storage).

        They outlive the pass that creates them, so they are never inference tensors, even
        when the first forward runs under ``torch.inference_mode`` (evaluation first).
        """
        if self.unsharded_flat is not None or self.sharded_flat is None:
            return
        owner = self.storage_owner
        with torch.inference_mode(False), torch.no_grad():
            if owner is StorageOwner.SHARDED_STORAGE:
                base, scale = self.sharded_flat, 1
            else:
                base = torch.empty(
                    self.world * self.total, dtype=self.param_dtype, device=self.device
                )
                scale = self.world
            for p, seg in zip(self.params, self.segments):
                view = alias(base, scale * seg.offset, p.unsharded_shape, p.unsharded_stride)
                if p.wrap_unsharded is not None:
                    view = p.wrap_unsharded(view)
                p.set_unsharded(nn.Parameter(view, requires_grad=p.requires_grad), owner)
        self.unsharded_flat = base
        self.unsharded_nbytes = base.numel() * base.element_size()
        self._gather_views = None
        if owner is not StorageOwner.SHARDED_STORAGE:
            free(base)

    def _alloc_unsharded(self, comm: Comm | None = None) -> bool:
        """Give the unsharded buffer its memory: parked memory of its size if any is idle.

        ``comm``: an all-gather will write into it, so on accelerators the memory comes
        from the all-gather stream (see ``Comm.gather_allocation``). Returns whether it
        was allocated now (False: it already had its memory).
        """
        storage = self.unsharded_flat.untyped_storage()
        nbytes = self.unsharded_nbytes
        if storage.size() == nbytes:
            return False
        pool = self._storage_pool
        if pool is None or storage.size() != 0 or not pool.unpark(storage, nbytes):
            if comm is not None and not comm.is_cpu:
                with comm.gather_allocation():
                    storage.resize_(nbytes)
                self._gathered_memory = True
            else:
                storage.resize_(nbytes)
        return True

    def _free_unsharded(self) -> None:
        """Reshard's release of the unsharded buffer: parked for the next unshard (CPU)."""
        flat = self.unsharded_flat
        if flat is None or flat is self.sharded_flat:
            return
        storage = flat.untyped_storage()
        if storage.size() == 0:
            return
        self._release_unsharded()
        if self._storage_pool is not None:
            self._storage_pool.park(storage)
        else:
            storage.resize_(0)

    def _release_unsharded(self) -> None:
        """Before memory the all-gather stream allocated for the unsharded buffer is freed."""
        if self._gathered_memory:
            self._gathered_memory = False
            self._comm.release_gathered()
