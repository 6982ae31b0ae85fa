"""Memory helpers shared by buckets and post-forward shards: views with their own version
counters, storage freed and re-allocated in place, zero-offset aliases of flat buffers."""

from __future__ import annotations

import torch


def free(t: torch.Tensor | None) -> None:
    if t is not None and t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)


def alloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().size() != nbytes:
        t.untyped_storage().resize_(nbytes)


def standalone(view: torch.Tensor) -> torch.Tensor:
    """The same memory as ``view``, as a tensor with its own storage starting at it.

    Members' local shards live inside their bucket's flat buffer, mostly at a nonzero
    storage offset. A DTensor wrapping such a view reports a nonzero ``data_ptr()``
    and then fails ``copy.deepcopy`` (so ``deepcopy(model.state_dict())`` would), and
    ``torch.save`` would write the whole flat buffer for every shard. DLPack gives a
    zero-offset tensor on the same memory that keeps the buffer alive.
    """
    if view.device.type == "meta":
        return view
    try:
        return torch.from_dlpack(view)
    except (RuntimeError, TypeError, BufferError):  # a device or dtype DLPack cannot carry
        return view


def alias(base: torch.Tensor, offset: int, shape: tuple[int, ...], stride) -> torch.Tensor:
    """A tensor on ``base``'s storage with its own version counter.

    Writes into ``base`` (all-gathers, copy-outs) must not bump the version counter
    of the unsharded parameters that autograd saved for backward.
    """
    return torch.empty(0, dtype=base.dtype, device=base.device).set_(
        base.untyped_storage(), base.storage_offset() + offset, shape, stride
    )
