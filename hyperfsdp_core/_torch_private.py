"""The only place hyperfsdp touches private PyTorch APIs; each use says why.

Everything else is written against public APIs. If a use here breaks on a new
torch release, this module is the one to adapt.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
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
