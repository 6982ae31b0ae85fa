"""Pools of communication memory on CPU (accelerators' caching allocators need none):
:class:`BufferPool` reuses all-gather outputs and reduce-scatter inputs,
:class:`StoragePool` parks the memory of resharded unsharded buffers for the next unshard."""

from __future__ import annotations

import torch


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


class StoragePool:
    """Memory of resharded unsharded buffers, handed back at the next unshard (CPU only).

    Reshard parks a buffer's memory here instead of freeing it (the buffer's storage is
    then empty, as after ``resize_(0)``); an unshard of the same byte size takes it back
    instead of faulting in fresh pages from the OS. Like :class:`BufferPool`: one size
    class at a time and at most ``max_idle`` parked buffers, emptied with the other
    pools at the end of every forward and backward. Parking changes where the pages come
    from, not how many are in use, as long as the memory is taken back at once:

    - in forward a unit reshards just before the next unit's unshard (its prefetch, or
      its own pre-forward where gathers run in line), which takes the memory; once the
      forward has no unshard left to issue, :meth:`stop` frees what is parked and
      reshards free until :meth:`resume`;
    - in backward (at most one buffer) a unit's reshard parks, its reduce-scatter input
      of the same size takes the memory (:meth:`take`), and once the reduce-scatter is
      done the input is parked again (:meth:`parks`) for the next unit's unshard, one
      buffer handed along the backward. A backward prefetch of a unit not yet unsharded
      is issued before the unit after it reshards, so it stops parking: parked memory
      would idle through a whole gradient computation.
    """

    def __init__(self, max_idle: int = 2) -> None:
        self.max_idle = max_idle
        self.parking = True
        self._key: int | None = None
        self._free: list[torch.UntypedStorage] = []

    def stop(self) -> None:
        """No unshard will take parked memory in this pass: free it, and free from now on."""
        self.parking = False
        self._free = []

    def resume(self, max_idle: int = 2) -> None:
        self.parking = True
        self.max_idle = max_idle

    def parks(self, storage: torch.UntypedStorage) -> bool:
        """Park ``storage``'s memory if it is of the size class parked now (a reduce-scatter
        input of a unit's unsharded size, done with: the next unit's unshard takes it)."""
        if not self.parking or storage.nbytes() != self._key:
            return False
        self.park(storage)
        return True

    def park(self, storage: torch.UntypedStorage) -> None:
        from .._torch_private import swap_storage_memory

        if not self.parking:
            storage.resize_(0)
            return
        nbytes = storage.nbytes()
        if nbytes != self._key:
            self._key = nbytes
            self._free = []
        if len(self._free) >= self.max_idle:
            storage.resize_(0)
            return
        holder = torch.UntypedStorage(0)
        swap_storage_memory(holder, storage)
        self._free.append(holder)

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        """Parked memory of ``nbytes`` as a storage of its own, or None if none is idle."""
        if nbytes != self._key or not self._free:
            return None
        return self._free.pop()

    def unpark(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give ``storage`` (empty) parked memory of ``nbytes``; False if none is idle."""
        if nbytes != self._key or not self._free:
            return False
        from .._torch_private import swap_storage_memory

        swap_storage_memory(storage, self._free.pop())
        return True

    def clear(self) -> None:
        self._free = []

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._free)
