"""The hyperfsdp plugin contract.

Every hook is declared here, grouped by when it runs. Plugins implement them with
``@hyperfsdp_core.hookimpl``. Hooks marked *lazy-init* are called once per unit at
the root's first forward and return plain callables that the per-step hot path
then calls directly, so a plugin that does not care costs nothing per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse

    import torch
    from torch import nn

    from ._mesh_info import MeshInfo
    from ._param import HSDPParam
    from ._plugins import Phase
    from ._reduction import Reduction
    from ._state import FSDPState
    from ._unit import UnitSpec

hookspec = pluggy.HookspecMarker("hyperfsdp")

# --------------------------------------------------------------------------------------
# init: fully_shard() time, before any parameter is touched or any collective is issued
# --------------------------------------------------------------------------------------


@hookspec
def hyperfsdp_validate_unit(unit: UnitSpec) -> None:
    """Check one ``fully_shard`` call's inputs; raise ``ValueError``/``ImportError`` to reject.

    Runs before the module is modified. Errors should name the parameter FQNs
    involved (``unit.named_params``), say what is wrong and what to do instead.

    :param unit: the modules, the parameters this call manages, the mesh and options.
    """


@hookspec(firstresult=True)
def hyperfsdp_select_mesh_info(unit: UnitSpec, fqn: str, param: nn.Parameter) -> MeshInfo | None:
    """Choose the data-parallel topology of one managed parameter.

    Stops at the first non-``None`` result. The core's own implementation runs last
    and handles 1-D meshes (FSDP); it raises for layouts that need a plugin that is
    not installed (for example a 2-D mesh without ``hyperfsdp[hsdp]``). Return the
    same (frozen) MeshInfo object for parameters that share a topology.

    :param unit: the ``fully_shard`` call being processed.
    :param fqn: the parameter's name relative to the unit's module(s).
    :param param: the parameter, before sharding.
    """


@hookspec
def hyperfsdp_module_mixins(unit: UnitSpec) -> Sequence[type] | None:
    """Mixin classes to union into the unit's module classes, besides ``FSDPModule``.

    The resulting class is ``FSDP<Name>`` with bases ``(FSDPModule, *mixins, Orig)``
    and is cached per original class and mixin set.
    """


@hookspec(firstresult=True)
def hyperfsdp_param_dtypes(
    unit: UnitSpec, param: nn.Parameter
) -> tuple[torch.dtype | None, torch.dtype | None] | None:
    """Return ``(param_dtype, reduce_dtype)`` for one parameter, or ``None`` for no opinion.

    ``param_dtype`` is the dtype of the all-gather and of the unsharded (compute)
    parameter; ``reduce_dtype`` that of the gradient reduction. ``None`` entries mean
    the parameter's original dtype. Stops at the first non-``None`` result.
    """


# --------------------------------------------------------------------------------------
# forward: resolved at lazy init into per-unit lists of callables
# --------------------------------------------------------------------------------------


@hookspec
def hyperfsdp_forward_input_transform(
    state: FSDPState,
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]] | None:
    """*lazy-init* Return a callable applied to each forward's ``(args, kwargs)``, or ``None``.

    Called once per unit; the callables run in each module's forward pre-hook, after
    the parameters are unsharded.
    """


@hookspec
def hyperfsdp_forward_output_transform(state: FSDPState) -> Callable[[Any], Any] | None:
    """*lazy-init* Return a callable applied to each module's forward output, or ``None``."""


# --------------------------------------------------------------------------------------
# backward: resolved at lazy init into per-bucket lists of callables
# --------------------------------------------------------------------------------------


@hookspec
def hyperfsdp_gradient_reducers(state: FSDPState) -> Callable[[list[Reduction]], None] | None:
    """*lazy-init* Return a reducer for a unit's reduced gradients, or ``None``.

    Called once per unit at the root's lazy init (and again when the unit's buckets are
    rebuilt). The reducer is called once per post-backward of the unit, when the core
    drains that unit's reduce-scatters (in the next unit's post-backward or in the
    ``core.reduce_scatter_drain`` phase), with the list of this post-backward's
    :class:`~hyperfsdp_core._reduction.Reduction` objects (one per bucket that reduced),
    every one of them complete. A reducer may take a reduction over (for example to
    all-reduce it over a replicate group and apply it in a later finalization phase)
    by calling ``reduction.defer()``; the core applies the others right after.
    """


# --------------------------------------------------------------------------------------
# finalize: the root's end-of-backward callback
# --------------------------------------------------------------------------------------


@hookspec
def hyperfsdp_finalize_phases() -> Sequence[Phase]:
    """Declare finalization phases run by the root after every backward.

    A :class:`~hyperfsdp_core._plugins.Phase` names itself and the phases it runs
    ``after``/``before``. The core resolves one order when plugins are registered
    (topological, ties broken by name); cycles and unknown names are errors, and the
    offending registration is rolled back. The core's reduce-scatter drain
    (``core.reduce_scatter_drain``) always runs first. A root captures the order at its
    lazy init; each ``run(ctx)`` then runs at the end of every backward that has
    ``is_last_backward`` set, with the root's
    :class:`~hyperfsdp_core._context.RootContext`.
    """


# --------------------------------------------------------------------------------------
# state dict: reacting to new parameter storage
# --------------------------------------------------------------------------------------


@hookspec
def hyperfsdp_param_reset(param: HSDPParam) -> None:
    """A managed parameter's sharded storage was rebuilt.

    Called after ``load_state_dict(assign=True)``, ``module.to(...)``/``_apply`` and
    ``to_empty()``, once the padded communication storage is rebuilt.
    """


# --------------------------------------------------------------------------------------
# command line: the ``hyperfsdp`` command
# --------------------------------------------------------------------------------------


@hookspec
def hyperfsdp_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add subcommands to the ``hyperfsdp`` command line.

    Called once per invocation of ``hyperfsdp`` (or ``python -m hyperfsdp_core``),
    while the parser is built, after the core's own commands are added.

    :param subparsers: the ``argparse`` subparsers object of the ``hyperfsdp`` parser;
        call ``subparsers.add_parser(name, help=...)`` and ``set_defaults(func=...)`` on
        the new parser. ``func(args)`` runs the command and returns the exit status
        (``None`` means 0).
    :returns: nothing.
    """
