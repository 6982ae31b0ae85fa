"""The public API for hyperfsdp plugin authors: everything a plugin may use, nothing else.

A plugin imports from here (and from ``hyperfsdp_core``'s top level), never from the
core's private modules (the sub-packages ``comm``, ``engine`` and ``cli``, and the modules
of ``plugin`` other than this one), which change freely between releases.
The names below are stable within a major :data:`API_VERSION`; a plugin declares the
versions it supports in its module (``HYPERFSDP_API = ">=1.0,<2"``) and the core
refuses to load it on a mismatch.

- Hooks: :data:`hookimpl` marks implementations of the hooks in
  :mod:`hyperfsdp_core.plugin.hookspecs` (documented in ``docs/plugin_hooks.md``).
- Finalization: :class:`Phase` declares a step of the root's end-of-backward pipeline;
  :data:`FIRST_PHASE` is the core's reduce-scatter drain.
- Views (read-only): :class:`UnitSpec` (a ``fully_shard`` call, at init),
  :class:`UnitView`, :class:`ParamView`, :class:`RootView`; plugins keep their own
  data in each view's ``stash`` under a :class:`StashKey`; :func:`unit_of` gives a
  sharded module's unit (from a mixin's methods, say).
- Topology: :class:`MeshInfo` and :func:`fsdp_mesh_info`, :func:`hsdp_mesh_info`,
  :func:`ddp_mesh_info`; :class:`ProcessGroupCache` for groups a plugin creates;
  :func:`placements_for` gives the core's default placements for a topology;
  :func:`group_timeout` reads the timeout a process group was created with.
- Layout and storage records returned by hooks: :class:`ParamLayout`,
  :class:`ShardedStorage`.
- Communication: :class:`PluginComm` (``root.comm``) issues async collectives and
  returns :class:`Work`; observers receive :class:`CollectiveEvent`. :class:`Transport`
  (returned by the ``hyperfsdp_transport`` hook) carries a unit's collectives, built from
  FSDP2's ``AllGather``/``ReduceScatter`` comm objects; a transport tells the observers
  what it puts on the wire with :func:`report_wire`. :class:`GlooTransport` is the core's
  default on CPU, to subclass; :func:`modes_set_aside` runs a transport's own workings
  unseen by torch dispatch modes.
- Gradients: reducers receive :class:`Reduction` objects (``params``, ``output``,
  ``grad_of()``, ``defer()``/``release()``, ``consume()``, ``key``, ``unit``,
  ``all_reduce_divisor``).
"""

from .._torch_private import group_timeout, modes_set_aside
from ..comm import CollectiveEvent, GlooTransport, PluginComm, Transport, Work, report_wire
from ..engine.mesh_info import (
    MeshInfo,
    ProcessGroupCache,
    ddp_mesh_info,
    fsdp_mesh_info,
    hsdp_mesh_info,
    mesh_device,
)
from ..engine.param import placements_for
from ..engine.records import ParamLayout, ShardedStorage
from ..engine.reduction import Reduction
from ..engine.spec import UnitSpec
from ..engine.stash import Stash, StashKey
from .manager import build_plugin_manager, get_plugin_manager, hookimpl
from .phases import FIRST_PHASE, Phase, PhaseOrderError
from .versions import API_ATTRIBUTE, API_VERSION, PluginLoadError, PluginVersionError, supports_api
from .views import ParamView, RootView, UnitView, unit_of

__all__ = [
    "API_ATTRIBUTE",
    "API_VERSION",
    "FIRST_PHASE",
    "CollectiveEvent",
    "GlooTransport",
    "MeshInfo",
    "ParamLayout",
    "ParamView",
    "Phase",
    "PhaseOrderError",
    "PluginComm",
    "PluginLoadError",
    "PluginVersionError",
    "ProcessGroupCache",
    "Reduction",
    "RootView",
    "ShardedStorage",
    "Stash",
    "StashKey",
    "Transport",
    "UnitSpec",
    "UnitView",
    "Work",
    "build_plugin_manager",
    "ddp_mesh_info",
    "fsdp_mesh_info",
    "get_plugin_manager",
    "group_timeout",
    "hookimpl",
    "hsdp_mesh_info",
    "mesh_device",
    "modes_set_aside",
    "placements_for",
    "report_wire",
    "supports_api",
    "unit_of",
]
