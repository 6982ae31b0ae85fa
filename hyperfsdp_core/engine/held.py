"""Unsharded parameters held past their unit's hooks, and the optimizer step that drops them.

A unit's unsharded parameters (or its ``reshard_after_forward=<int>`` post-forward
shard) are *copies* of its sharded parameters. Most of the time they live only inside
a forward or a backward, but some stay held past the unit's hooks:

* the root's (and ``reshard_after_forward=False`` units') after a forward that no
  backward follows (``no_grad``, ``inference_mode``, an ``eval()`` forward whose output
  is never differentiated), and, until their backward, after any forward;
* after a backward with ``set_reshard_after_backward(False)``;
* after an explicit ``unshard()``.

An optimizer step writes the sharded parameters in place; a held copy would then be
stale, and the next forward would compute with the pre-step weights (while
``model.parameters()`` showed them too). So every held group is registered here, and a
global ``torch.optim`` step pre-hook reshards the held groups whose parameters that
optimizer updates, before its step: the sharded parameters are registered again, and
the next forward gathers the new values. The hook covers every ``torch.optim.Optimizer``
(for-loop, ``foreach`` and ``fused`` kernels alike, and user subclasses however they
write), because it does not look at what the step wrote, only at who steps.

Code that writes the sharded parameters outside an optimizer's ``step`` while a unit is
held calls ``module.reshard()`` first (as with FSDP2).

The registry is process-wide (optimizer hooks are); it holds groups weakly, and the
membership test keeps one model's (or one thread-rank's) step from touching another's.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

from torch.optim.optimizer import register_optimizer_step_pre_hook


class Root(Protocol):
    """A holder's root (``RootContext``): whether its backward runs."""

    @property
    def in_backward(self) -> bool: ...


class Holdable(Protocol):
    def held_param_ids(self) -> set[int]: ...

    def drop_held(self) -> None: ...

    def in_backward(self) -> bool: ...


_lock = threading.Lock()
_held: weakref.WeakSet[Any] = weakref.WeakSet()
_hook_installed = False


def hold(group: Holdable) -> None:
    """``group`` keeps unsharded memory past its hooks: drop it before an optimizer steps."""
    global _hook_installed
    with _lock:
        _held.add(group)
        if not _hook_installed:
            _hook_installed = True
            register_optimizer_step_pre_hook(_before_step)


def release(group: Holdable) -> None:
    """``group`` holds nothing any more."""
    with _lock:
        _held.discard(group)


def held_groups() -> list[Any]:
    with _lock:
        return list(_held)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not _held:
        return
    groups = held_groups()
    if not groups:
        return
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for group in groups:
        # An optimizer stepped from a backward hook (optimizer in backward) runs while
        # units are mid-backward: their held parameters are in use and are resharded by
        # their own post-backward.
        if group.in_backward():
            continue
        if not stepped.isdisjoint(group.held_param_ids()):
            group.drop_held()
