"""The engine's one door to the plugins: what it asks of them, defined here, answered above.

The engine never imports the plugin layer. ``fully_shard`` hands each unit a
:class:`PluginPort` (the plugin layer's ``plugin.dispatch.PluginDispatch``), and the engine
asks it, at construction and at lazy init, for:

- *views*: the read-only objects plugins are handed for a parameter, a unit and a root.
  The plugin layer builds them; the engine only stores them and passes them back into
  the callables below (opaque handles, never read here);
- *resolved hooks*: plain callables (:class:`GradientHooks`, :class:`RootHooks`, ...), so per-step
  cost does not grow with the number of plugins that do not care.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import torch

#: An opaque view handle (``ParamView``, ``UnitView``, ``RootView`` of the plugin layer).
View = Any


@attrs.frozen
class GradientHooks:
    """A unit's gradient hooks, resolved once its storage exists (lazy init, and after a
    rebuild), after its all-gather input (``PluginPort.all_gather_input``) and transport."""

    #: ``reducer(reductions)`` per post-backward, in order
    reducers: tuple[Callable[[list], None], ...]
    #: ``land(param_view, local) -> local`` before a reduced shard lands, or None
    land_grad: Callable[[View, torch.Tensor], torch.Tensor] | None


@attrs.frozen
class ForwardHooks:
    """A unit's forward transforms, resolved at lazy init."""

    inputs: tuple[Callable[[tuple, dict], tuple[tuple, dict]], ...]
    outputs: tuple[Callable[[Any], Any], ...]


@attrs.frozen
class RootHooks:
    """A root's hooks, resolved at its lazy init."""

    #: ``(name, run)`` per finalization phase, in their declared order; ``run(root_view)``
    finalize_runs: tuple[tuple[str, Callable[[View], None]], ...]
    #: ``observer(event)`` per collective
    observers: tuple[Callable[[Any], None], ...]


class PluginPort(Protocol):
    """What the engine asks of the plugin layer (implemented by ``plugin.dispatch``)."""

    def param_view(self, param: Any) -> View: ...

    def unit_view(self, state: Any) -> View: ...

    def root_view(self, ctx: Any) -> View: ...

    def all_gather_input(
        self, unit: View
    ) -> Callable[[torch.Tensor, torch.Tensor], None] | None: ...

    def gradient_hooks(self, unit: View) -> GradientHooks: ...

    def forward_hooks(self, unit: View) -> ForwardHooks: ...

    def root_hooks(self, root: View) -> RootHooks: ...

    def transport_question(self, unit: View) -> Callable[[], Any]: ...

    def param_dtypes(
        self, spec: Any, param: torch.Tensor
    ) -> tuple[torch.dtype | None, torch.dtype | None]: ...

    def param_reset(self, param: View) -> None: ...
