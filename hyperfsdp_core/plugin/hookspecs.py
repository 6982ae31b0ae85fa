"""The hyperfsdp plugin contract (plugin API version: ``hyperfsdp_core.plugin.API_VERSION``).

Every hook is declared here, grouped by when it runs; ``docs/plugin_hooks.md``
documents each with an example. Plugins implement them with
``@hyperfsdp_core.plugin.hookimpl`` and use only the types of
:mod:`hyperfsdp_core.plugin`. Hooks marked *lazy-init* are called once per unit (or
root) at the root's first forward and return plain callables (or ``None``) that the
per-step hot path then calls directly, so a plugin that does not care costs nothing
per step. Hooks marked *first result* stop at the first implementation that returns
something other than ``None``; all other hooks call every implementation.
``@hookimpl(wrapper=True)`` generators wrap the other implementations of a hook (the
``yield`` returns their result, the wrapper's ``return`` replaces it); ``hyperfsdp
plugins`` lists who answers each first-result hook, in the order they are asked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse

    import torch
    from torch import nn

    from ..comm import CollectiveEvent, Transport
    from ..engine.mesh_info import MeshInfo
    from ..engine.records import ParamLayout, ShardedStorage
    from ..engine.reduction import Reduction
    from ..engine.spec import UnitSpec
    from .phases import Phase
    from .views import ParamView, RootView, UnitView

hookspec = pluggy.HookspecMarker("hyperfsdp")

# --------------------------------------------------------------------------------------
# init: fully_shard() time, before any parameter is touched or any collective is issued
# --------------------------------------------------------------------------------------


@hookspec
def hyperfsdp_validate_unit(unit: UnitSpec) -> None:
    """Check one ``fully_shard`` call's inputs; raise to reject it.

    Runs first in ``fully_shard``, once per call, before anything is modified. Every
    implementation runs; the first exception aborts ``fully_shard`` and leaves the
    module untouched. Errors should name the parameter FQNs involved
    (``unit.named_params``), say what is wrong and what to do instead.

    :param unit: the modules, the parameters this call manages, the mesh and options.
    :returns: nothing; raise ``ValueError`` (bad input) or ``ImportError`` (a needed
        plugin is missing) to reject the call.
    """


@hookspec(firstresult=True)
def hyperfsdp_select_mesh_info(unit: UnitSpec, fqn: str, param: nn.Parameter) -> MeshInfo | None:
    """Choose the data-parallel topology of one managed parameter. *First result.*

    The core's implementation runs last and handles 1-D meshes (FSDP); it raises
    an ``ImportError`` naming the extra to install for layouts that need a plugin
    (a 2-D mesh, DTensor parameters, ``replicate_params``, ``dp_mesh_dims``).

    :param unit: the ``fully_shard`` call being processed.
    :param fqn: the parameter's name relative to the unit's module(s).
    :param param: the parameter, before sharding.
    :returns: a frozen :class:`~hyperfsdp_core.plugin.MeshInfo` (return the same
        object for parameters that share a topology), or ``None`` to let the next
        implementation decide.
    """


@hookspec(firstresult=True)
def hyperfsdp_param_layout(
    unit: UnitSpec, fqn: str, param: nn.Parameter, mesh_info: MeshInfo, shard_dim: int
) -> ParamLayout | None:
    """Decide what tensor is sharded and the DTensor spec of the sharded parameter. *First result.*

    The core's implementation runs last: it shards the parameter itself on
    ``shard_dim`` and gives the DTensor ``mesh_info.mesh`` with ``Shard(shard_dim)``
    on the shard mesh dim (``Replicate()`` elsewhere). A tensor-parallel plugin
    returns the TP-local tensor instead, a DTensor spec over the data-parallel and
    TP dims (``_StridedShard`` where both shard dim 0), and callables that wrap the
    all-gathered tensor as a TP DTensor and unwrap its gradient.

    :param unit: the ``fully_shard`` call being processed.
    :param fqn: the parameter's name relative to the unit's module(s).
    :param param: the parameter, before sharding.
    :param mesh_info: the topology chosen by ``hyperfsdp_select_mesh_info``.
    :param shard_dim: the dim to shard (0, or what ``shard_placement_fn`` asked for).
    :returns: a :class:`~hyperfsdp_core.plugin.ParamLayout`, or ``None``. The core then
        checks that a non-zero ``shard_dim`` of ``layout.tensor`` divides evenly.
    """


@hookspec(firstresult=True)
def hyperfsdp_param_dtypes(
    unit: UnitSpec, param: nn.Parameter
) -> tuple[torch.dtype | None, torch.dtype | None] | None:
    """Choose the compute (all-gather) dtype and the reduce dtype of one parameter. *First result.*

    Asked in ``fully_shard``, and again for a parameter whose dtype a conversion of the
    sharded model (``model.to(dtype)``, ``half()``, ``float()``) changed.

    :param unit: the ``fully_shard`` call; ``unit.mp_policy`` is the user's policy.
    :param param: the parameter, before sharding.
    :returns: ``(param_dtype, reduce_dtype)``, ``None`` entries meaning the parameter's
        own dtype (``reduce_dtype``: the compute dtype), or ``None`` for no opinion.
    """


@hookspec(firstresult=True)
def hyperfsdp_sharded_storage(unit: UnitSpec) -> ShardedStorage | None:
    """Choose where the unit's sharded storage lives. *First result.*

    The sharded storage holds the actual shards (the optimizer's parameters); its
    device is also where gradients land and the optimizer state lives. ``None`` from
    every implementation means the unit's compute device. The core rejects an
    ``offload_policy`` other than the default ``OffloadPolicy()`` that no
    implementation answered, naming the extra to install.

    :param unit: the ``fully_shard`` call; ``unit.offload_policy`` is the user's policy.
    :returns: a :class:`~hyperfsdp_core.plugin.ShardedStorage` (device, pin_memory), or ``None``.
    """


@hookspec
def hyperfsdp_module_mixins(unit: UnitSpec) -> Sequence[type] | None:
    """Mixin classes to union into the unit's module classes, besides ``FSDPModule``.

    :param unit: the ``fully_shard`` call being processed.
    :returns: a sequence of classes, or ``None``. The results of all implementations
        are concatenated (duplicates dropped); the class becomes ``FSDP<Name>`` with
        bases ``(FSDPModule, *mixins, Orig)``, cached per original class and mixin set.
    """


# --------------------------------------------------------------------------------------
# forward: resolved at lazy init into per-unit callables
# --------------------------------------------------------------------------------------


@hookspec
def hyperfsdp_forward_input_transform(
    unit: UnitView,
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]] | None:
    """*lazy-init* A callable applied to each forward's ``(args, kwargs)`` of the unit.

    :param unit: the unit.
    :returns: ``fn(args, kwargs) -> (args, kwargs)``, run in each of the unit's modules'
        forward pre-hooks after the parameters are unsharded, or ``None``.
    """


@hookspec
def hyperfsdp_forward_output_transform(unit: UnitView) -> Callable[[Any], Any] | None:
    """*lazy-init* A callable applied to each forward output of the unit.

    :param unit: the unit.
    :returns: ``fn(output) -> output``, run in the forward post-hook after the core's
        own post-forward work, or ``None``.
    """


@hookspec(firstresult=True)
def hyperfsdp_all_gather_input(
    unit: UnitView,
) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    """*lazy-init* How the all-gather input is produced from the sharded storage. *First result.*

    By default the all-gather reads the flat sharded storage in place when dtype and
    device match (no copy), and otherwise copies (casts, moves) it into this rank's
    slot of the output (an in-place all-gather). A callable returned here replaces
    that copy for every bucket of the unit, and the in-place path is always taken.

    :param unit: the unit.
    :returns: ``fill(sharded, dest)``: write this rank's all-gather input into ``dest``
        (flat, ``param_dtype``, on the compute device) from ``sharded`` (the flat
        sharded storage, original dtype, on the storage device, padding included);
        it runs on the all-gather stream on accelerators. Or ``None``.
    """


@hookspec(firstresult=True)
def hyperfsdp_transport(unit: UnitView) -> Transport | None:
    """*lazy-init* What carries the unit's collectives. *First result.*

    Called once per unit at its root's lazy init. The returned
    :class:`~hyperfsdp_core.plugin.Transport` carries every all-gather and reduce-scatter
    of the unit's buckets (its post-forward all-gathers under
    ``reshard_after_forward=<int>`` too) and the all-reduces plugins issue through
    ``root.comm`` with ``unit=unit.fqn``. Build it from FSDP2 comm objects
    (``Transport(all_gather=AllGather(), reduce_scatter=ReduceScatter(),
    all_reduce=fn)``: ``allocate(sizes, *, dtype, device)`` plus ``__call__``) or subclass
    it to pick a route per group, size or dtype. A part left ``None`` is
    ``torch.distributed``'s own collective. ``set_custom_all_gather`` /
    ``set_custom_reduce_scatter`` take precedence for their collective over the unit's
    own group.

    A transport is called as it is, also while a torch dispatch mode (``CommDebugMode``)
    is active, which may be on some ranks only: a route must depend only on what every
    rank agrees on, never on a mode. A default transport (``hyperfsdp-shm``'s) implements this ``trylast`` and
    keeps per-root state in ``unit.root.stash``.

    :param unit: the unit.
    :returns: a ``Transport``, or ``None`` (the core's default: ``torch.distributed``'s
        own collectives).
    """


# --------------------------------------------------------------------------------------
# backward: resolved at lazy init into per-unit callables
# --------------------------------------------------------------------------------------


@hookspec
def hyperfsdp_gradient_reducers(
    unit: UnitView,
) -> Callable[[Sequence[Reduction]], None] | None:
    """*lazy-init* A reducer for the unit's reduced gradients.

    Called once per unit at the root's lazy init (and again when the unit's storage
    is rebuilt). The reducer is called once per post-backward of the unit that
    reduced, when the core finishes that post-backward's reduce-scatters (in the next
    unit's post-backward or in the ``core.reduce_scatter_drain`` phase), with one
    complete :class:`~hyperfsdp_core.plugin.Reduction` per bucket. A reducer may
    ``defer()`` a reduction (e.g. to all-reduce it asynchronously and ``release()``
    it from a finalization phase) or ``consume()`` it; the core releases its own
    hold right after the reducers ran, and a reduction lands on ``.grad`` when its
    last hold is released.

    :param unit: the unit.
    :returns: ``reducer(reductions) -> None``, or ``None``.
    """


@hookspec(firstresult=True)
def hyperfsdp_grad_landing(
    unit: UnitView,
) -> Callable[[ParamView, torch.Tensor], torch.Tensor] | None:
    """*lazy-init* Where reduced gradient shards land. *First result.*

    The core's implementation runs last: when the unit's sharded storage is on
    another device than its compute device, it copies each shard there
    (a blocking copy); otherwise it returns ``None``.

    :param unit: the unit.
    :returns: ``land(param, shard) -> tensor``: given a parameter and its reduced
        shard (``param.local_shape``, reduce dtype, compute device), the tensor to
        set as or add to the parameter's ``.grad`` local tensor (the core casts it to
        ``param.orig_dtype``), or ``None`` for the shard as it is.
    """


# --------------------------------------------------------------------------------------
# finalize: the root's end-of-backward callback
# --------------------------------------------------------------------------------------


@hookspec
def hyperfsdp_finalize_phases() -> Sequence[Phase]:
    """Declare finalization phases run by the root at the end of every backward.

    Called when plugins are registered. The core orders all phases once
    (topologically, ties broken by name); cycles, unknown names and duplicates are
    errors (:class:`~hyperfsdp_core.plugin.PhaseOrderError`, naming the plugins) and roll
    a run-time registration back; between installed plugins the error is raised when the
    plugin manager is built, so every ``fully_shard`` raises it, with the
    ``HYPERFSDP_PLUGINS_DISABLE`` setting that leaves one of them out.
    ``core.reduce_scatter_drain`` always runs first. A root captures the order at its lazy init; each phase's ``run(root)``
    then runs with the root's :class:`~hyperfsdp_core.plugin.RootView` after every
    backward (the root drains unconditionally) and after ``reduce_grads()``: a phase acts
    only on the work collected since its last run, and must be safe with none.

    :returns: a sequence of :class:`~hyperfsdp_core.plugin.Phase`.
    """


@hookspec
def hyperfsdp_collective_observer(root: RootView) -> Callable[[CollectiveEvent], None] | None:
    """*lazy-init* An observer called for every collective the root's communication issues.

    Called once per root at its lazy init. The observer is called synchronously, on
    the thread that issues each collective, right after its transport issued it
    (all-gathers, reduce-scatters, plugins' collectives through ``root.comm``); keep it
    cheap. The event shows the logical collective (``nbytes``, ``dtype``) and what the
    transport put on the wire (``wire_nbytes``, ``wire_dtype``; see
    :func:`~hyperfsdp_core.plugin.report_wire`).

    :param root: the root.
    :returns: ``observer(event)`` taking a :class:`~hyperfsdp_core.plugin.CollectiveEvent`,
        or ``None``.
    """


# --------------------------------------------------------------------------------------
# state dict: saving, loading and rebuilt storage
# --------------------------------------------------------------------------------------


@hookspec
def hyperfsdp_state_dict_pre_save(unit: UnitView) -> None:
    """The unit's module is about to produce its ``state_dict()``.

    Runs in the module's state-dict pre-hook, after the core resharded the unit (so
    the registered parameters are the sharded DTensors).

    :param unit: the unit.
    :returns: nothing.
    """


@hookspec(firstresult=True)
def hyperfsdp_load_convert(param: ParamView, value: torch.Tensor) -> torch.Tensor | None:
    """Convert a loaded value for a managed parameter before the core uses it. *First result.*

    Runs in ``load_state_dict``'s pre-hook for each managed parameter whose incoming
    value is not a DTensor with the parameter's mesh and placements. The core's
    implementation runs last: a plain tensor of the parameter's global shape becomes
    this rank's shard (no communication); anything else is left for the core's
    validation, which names the parameter and what it expected.

    :param param: the parameter.
    :param value: the incoming state-dict value.
    :returns: the value to load instead (a DTensor with ``param.placements`` on
        ``param.device_mesh``), or ``None`` to leave it as it is.
    """


@hookspec
def hyperfsdp_state_dict_post_load(unit: UnitView) -> None:
    """The unit's module finished ``load_state_dict()``.

    :param unit: the unit (its parameters' local tensors are views of its sharded storage,
        padding zeroed: the same storage with new values after a copying load, rebuilt
        storage after ``assign=True``).
    :returns: nothing.
    """


@hookspec
def hyperfsdp_param_reset(param: ParamView) -> None:
    """A managed parameter's sharded storage was rebuilt, or loaded in place.

    Called after ``load_state_dict`` (a copying load keeps the storage and changes the
    values; ``assign=True`` rebuilds it), ``module.to(...)``/``_apply`` and ``to_empty()``,
    once the padded communication storage holds the (new) shards.

    :param param: the parameter.
    :returns: nothing.
    """


# --------------------------------------------------------------------------------------
# inspection: sharding_plan()
# --------------------------------------------------------------------------------------


@hookspec
def hyperfsdp_plan_columns(param: ParamView) -> Mapping[str, Any] | None:
    """Extra ``sharding_plan()`` columns for one parameter.

    :param param: the parameter.
    :returns: a mapping ``column name -> value`` (merged over plugins; ``str(value)`` is
        shown in the table, ``None`` shows as ``-``), or ``None``. The values are in
        each row's ``extra``; the column ``tp_replicate_axis`` also fills the row field
        of that name.
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
