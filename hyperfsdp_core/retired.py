"""Parameters that fully_shard replaced, and the check that keeps an optimizer off them.

fully_shard swaps each managed parameter for a sharded DTensor. An optimizer built before
the call still holds the old parameters: its step would update tensors the model no longer
uses. The old parameters are remembered here (weakly, with their FQN) so that such a step
fails with a message, and so that a later fully_shard call can name a parameter shared
with a unit that already replaced it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook


class RetiredParams:
    """Parameters fully_shard replaced, by identity (weakly held), with their FQN."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, str]] = {}

    def add(self, param: nn.Parameter, fqn: str) -> None:
        key = id(param)
        self._entries[key] = (weakref.ref(param, lambda _, k=key: self._entries.pop(k, None)), fqn)

    def rename(self, param_id: int, fqn: str) -> None:
        """Give the replaced parameter whose identity is ``param_id`` a longer FQN (a parent's
        ``fully_shard`` names it from the parent)."""
        entry = self._entries.get(param_id)
        if entry is not None:
            self._entries[param_id] = (entry[0], fqn)

    def get(self, param: Any) -> str | None:
        entry = self._entries.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None

    def __bool__(self) -> bool:
        return bool(self._entries)


RETIRED = RetiredParams()
_optimizer_hook_installed = False


def install_optimizer_check() -> None:
    """Fail an optimizer step that would update parameters fully_shard replaced."""
    global _optimizer_hook_installed
    if _optimizer_hook_installed:
        return
    _optimizer_hook_installed = True

    def check(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if not RETIRED:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                fqn = RETIRED.get(p)
                if fqn is not None:
                    raise RuntimeError(
                        f"{type(optimizer).__name__} holds parameter {fqn!r} as it was before "
                        "fully_shard replaced it with a sharded DTensor, so its step would not "
                        "train the model. Build the optimizer after fully_shard, from "
                        "model.parameters()"
                    )

    register_optimizer_step_pre_hook(check)
