"""Which parameters use FSDP2's tensor-subclass all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), checked at ``fully_shard`` time; the
mechanism is ``engine/extension_payload.py``."""

from __future__ import annotations

import inspect

import torch

_SIGNATURE = (
    "fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) or "
    "fsdp_pre_all_gather(self, mesh)"
)


def extension_of(fqn: str, tensor: torch.Tensor, shard_dim: int) -> bool:
    """Whether ``tensor`` (the tensor FSDP shards) uses the all-gather extension; a clear
    error at ``fully_shard`` time if it does so in a way the core cannot serve."""
    pre = hasattr(tensor, "fsdp_pre_all_gather")
    post = hasattr(tensor, "fsdp_post_all_gather")
    if pre != post:
        have, lack = (
            ("fsdp_pre_all_gather", "fsdp_post_all_gather")
            if pre
            else ("fsdp_post_all_gather", "fsdp_pre_all_gather")
        )
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a {type(tensor).__name__} that defines {have} "
            f"but not {lack}; the all-gather extension needs both (define {lack}, or neither)"
        )
    if not pre:
        return False
    nargs = pre_arity(tensor)
    if nargs not in (1, 5):
        raise ValueError(
            f"fully_shard: parameter {fqn!r}: {type(tensor).__name__}.fsdp_pre_all_gather takes "
            f"{nargs} argument(s); the all-gather extension calls {_SIGNATURE}"
        )
    if shard_dim != 0:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a {type(tensor).__name__} with an all-gather "
            f"extension, sharded on dim {shard_dim}: the extension's payloads are gathered on "
            "dim 0 only; shard it on dim 0 (return None from shard_placement_fn for it)"
        )
    return True


def pre_arity(tensor: torch.Tensor) -> int:
    return len(inspect.signature(tensor.fsdp_pre_all_gather).parameters)


def initial_local(p, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """This rank's actual shard of an extension parameter, still the subclass (a
    ``detach`` would unwrap some subclasses, torchao's float8 weight among them). A
    parameter on the meta device stays there (``to_empty`` materializes it, as in FSDP2)."""
    with torch.no_grad():
        local = p.local_shard_of(tensor)
        return local if local.device.type == "meta" else local.to(device)
