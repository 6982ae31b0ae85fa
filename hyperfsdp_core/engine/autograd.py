"""Where a unit's hooks meet autograd: the identity function whose backward runs a unit's
post-backward, and the gradient hooks on a unit's outputs that start its backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._torch_private import tree_flatten, tree_unflatten


class RegisterPostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs the unit's post-backward."""

    @staticmethod
    def forward(ctx, state: Any, *inputs: torch.Tensor):  # type: ignore[override]
        ctx.unit_state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        state = ctx.unit_state
        root = state.ctx
        if root is not None and not root.in_backward:
            # No unit's output-gradient hook ran in this backward (a list unit's module
            # called on its own, e.g. a chunked loss's head): it still ends with the root
            # drain, so the gradients land on .grad when it returns, as in FSDP2.
            root.begin_backward()
        state.post_backward()
        return (None, *grads)


def _grad_tensors(tree: Any) -> tuple[list[Any], Any, list[int]]:
    leaves, spec = tree_flatten(tree)
    idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    return leaves, spec, idx


def register_post_backward(state: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with the tensors that require grad passed through
    :class:`RegisterPostBackward`, whose backward runs ``state``'s post-backward."""
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        # the common case (positional tensors only) without a pytree round trip
        idx = [i for i, a in enumerate(args) if a.requires_grad]
        if not idx:
            return args, kwargs
        outs = RegisterPostBackward.apply(state, *(args[i] for i in idx))
        new = list(args)
        for i, t in zip(idx, outs):
            new[i] = t
        return tuple(new), kwargs
    leaves, spec, idx = _grad_tensors((args, kwargs))
    if not idx:
        return args, kwargs
    outs = RegisterPostBackward.apply(state, *(leaves[i] for i in idx))
    for i, t in zip(idx, outs):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def register_pre_backward(hook: Callable, output: Any) -> Any:
    """Register ``hook`` (a unit's pre-backward) on the output tensors that require grad."""
    if not torch.is_grad_enabled():
        return output
    if isinstance(output, torch.Tensor):  # the common case, without a pytree walk
        if output.requires_grad:
            output.register_hook(hook)
        return output
    leaves, _, idx = _grad_tensors(output)
    for i in idx:
        leaves[i].register_hook(hook)
    return output
