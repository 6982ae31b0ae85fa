"""fully_shard() and the other public entry points."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ._torch_private import expose_fsdp2_state
from .comm import Comm
from .comm.exit import install_exit_drain
from .engine.extension import initial_local
from .engine.mesh_info import MeshInfo, check_mesh_device, mesh_device
from .engine.options import UnitOptions
from .engine.param import ShardedParam
from .engine.pipelining import StageReduceView
from .engine.records import ParamLayout
from .engine.spec import UnitSpec
from .engine.state import UnitState
from .engine.unit_params import UnitParams
from .module import FSDPModule, fsdp_class
from .plugin.dispatch import DISPATCH
from .plugin.manager import DISABLE_AUTOLOAD_ENV, get_plugin_manager
from .policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    as_dp_mesh_dims,
    as_mp_policy,
    as_offload_policy,
)
from .retired import RETIRED, install_optimizer_check
from .state_dict import register_state_dict_hooks

install_exit_drain()  # gloo workers finish with the GIL before finalization (see comm/exit.py)

_DEFAULT_MP = MixedPrecisionPolicy()
_DEFAULT_OFFLOAD = OffloadPolicy()


def fully_shard(
    module: nn.Module | Sequence[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = _DEFAULT_MP,
    offload_policy: OffloadPolicy = _DEFAULT_OFFLOAD,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    replicate_params: set[nn.Parameter] | None = None,
):
    """Shard ``module``'s parameters over ``mesh`` and hook its forward/backward (FSDP2 contract).

    Apply bottom-up: each call forms one communication group of the parameters that
    no earlier call on a submodule manages. Returns ``module`` (its class unioned with
    :class:`FSDPModule`), or the list when given a list. The policies may be torch's own
    (``torch.distributed.fsdp.MixedPrecisionPolicy``, ``OffloadPolicy``,
    ``CPUOffloadPolicy``), with the same meaning.
    """
    mp_policy, offload_policy = as_mp_policy(mp_policy), as_offload_policy(offload_policy)
    dp_mesh_dims = as_dp_mesh_dims(dp_mesh_dims)
    modules = _root_modules(module)
    mesh_was_default = mesh is None
    mesh = mesh if mesh is not None else default_mesh()
    check_mesh_device(mesh, type(modules[0]).__name__)
    _check_reshard_after_forward(reshard_after_forward)
    reshard_after_forward = _trivial_int_as_bool(reshard_after_forward, mesh, dp_mesh_dims)
    for m in modules:
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"fully_shard was already applied to this {type(m).__name__}; "
                "call it once per module (apply it bottom-up: submodules first, then the parent)"
            )
    named, registrations, sub_states = _collect_params(modules, set(ignored_params or ()))
    replicate = frozenset(replicate_params or ())
    unknown = [p for p in replicate if all(p is not q for _, q in named)]
    if unknown:
        raise ValueError(
            "replicate_params must be parameters that this fully_shard call manages; "
            f"{len(unknown)} given parameter(s) are not (ignored, managed by a submodule's "
            "fully_shard, or not in the module)"
        )
    unit = UnitSpec(
        modules=modules,
        named_params=tuple(named),
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        dp_mesh_dims=dp_mesh_dims,
        replicate_params=replicate,
        mesh_was_default=mesh_was_default,
    )
    # Decide everything before touching the module.
    plan = _decide(unit)
    _build(unit, plan, registrations, sub_states)
    return module


@attrs.frozen
class _UnitPlan:
    """What the plugins decided for one fully_shard call, before anything is touched:
    the sharded storage, ``(fqn, param, mesh_info, shard_dim, layout, dtypes)`` for each
    parameter, and the classes to mix into the modules' class."""

    storage: Any
    params: list[tuple[str, nn.Parameter, MeshInfo, int, ParamLayout, Any]]
    mixins: tuple[type, ...]


def _decide(unit: UnitSpec) -> _UnitPlan:
    """Ask the plugins about ``unit``: validation, storage, each parameter, the class mixins."""
    hook = get_plugin_manager().hook
    hook.hyperfsdp_validate_unit(unit=unit)
    storage = hook.hyperfsdp_sharded_storage(unit=unit)
    if storage is None and type(unit.offload_policy) is not OffloadPolicy:
        _unplaced_offload(unit.offload_policy)
    params = []
    for fqn, param in unit.named_params:
        mesh_info = hook.hyperfsdp_select_mesh_info(unit=unit, fqn=fqn, param=param)
        shard_dim = _shard_dim(unit, fqn, param)
        layout = hook.hyperfsdp_param_layout(
            unit=unit, fqn=fqn, param=param, mesh_info=mesh_info, shard_dim=shard_dim
        )
        _check_even(fqn, layout.tensor, shard_dim, mesh_info.shard_size)
        dtypes = hook.hyperfsdp_param_dtypes(unit=unit, param=param) or (None, None)
        params.append((fqn, param, mesh_info, shard_dim, layout, dtypes))
    mixins: list[type] = []
    for result in hook.hyperfsdp_module_mixins(unit=unit):
        for mixin in result or ():
            if mixin not in mixins:
                mixins.append(mixin)
    return _UnitPlan(storage, params, tuple(mixins))


def _build(
    unit: UnitSpec,
    plan: _UnitPlan,
    registrations: dict[int, list[tuple[nn.Module, str]]],
    sub_states: list[Any],
) -> None:
    """Replace the parameters as ``plan`` says and turn ``unit.modules`` into FSDP modules."""
    device, reshard = mesh_device(unit.mesh), unit.reshard_after_forward
    params, locals_by_param = [], {}
    for fqn, param, mesh_info, shard_dim, layout, (param_dtype, reduce_dtype) in plan.params:
        hp = ShardedParam(
            fqn, param, layout, registrations[id(param)], mesh_info, shard_dim, DISPATCH
        )
        hp.set_dtypes(param_dtype, reduce_dtype)
        locals_by_param[id(hp)] = _initial_local(hp, layout.tensor, device)
        params.append(hp)
        RETIRED.add(param, fqn)
    _move_managed_buffers(unit.modules, sub_states, device)
    group = UnitParams(params, device, plan.storage, unit.mp_policy) if params else None
    if group is not None:
        on_meta = any(t.device.type == "meta" for t in locals_by_param.values())
        group.build_sharded(locals_by_param, torch.device("meta") if on_meta else device)
        if not isinstance(reshard, bool) and isinstance(reshard, int):
            group.configure(post_forward_size=reshard)
    options = UnitOptions(
        reshard_after_forward=True if reshard is None else reshard,
        auto_reshard_after_forward=reshard is None,
        mp_policy=unit.mp_policy,
        offload_policy=unit.offload_policy,
        # the call's options for hooks asked again later (dtypes after a conversion),
        # without the original parameters (their full tensors would stay alive)
        unit_spec=attrs.evolve(unit, named_params=(), replicate_params=frozenset()),
        unit_fqns=tuple(fqn for fqn, _ in unit.named_params),
    )
    UnitState(unit.modules, group, device, options, DISPATCH)
    for m in unit.modules:
        # torch.distributed.pipelining reads a stage's FSDP2 state (see engine/pipelining.py)
        expose_fsdp2_state(m, StageReduceView(m))
        m.__class__ = fsdp_class(type(m), plan.mixins)
        register_state_dict_hooks(m)
    install_optimizer_check()


# -- helpers ------------------------------------------------------------------------------------


def _unplaced_offload(policy: OffloadPolicy) -> None:
    """Raise for an offload policy that no loaded plugin places sharded storage for."""
    pm = get_plugin_manager()
    off = []
    if pm.disabled:
        off.append(
            f"disabled in this process by {pm.disabled_by}: {', '.join(sorted(pm.disabled))}"
        )
    if not pm.autoloaded:
        off.append(
            "installed plugins are not loaded: entry-point autoload is off "
            f"({DISABLE_AUTOLOAD_ENV} or autoload=False)"
        )
    note = f" ({'; '.join(off)})" if off else ""
    if isinstance(policy, CPUOffloadPolicy):
        raise ImportError(
            f"offload_policy={policy!r} needs the offload plugin (pip install "
            f"hyperfsdp[offload]), which is not loaded in this process{note}. Pass "
            "OffloadPolicy() (the default) to keep parameters on the compute device"
        )
    raise ValueError(
        f"offload_policy={policy!r}: no loaded plugin places sharded storage for a "
        f"{type(policy).__qualname__} (none answered hyperfsdp_sharded_storage){note}. Install "
        "the plugin that defines it, or pass OffloadPolicy() (no offload) or CPUOffloadPolicy() "
        "(pip install hyperfsdp[offload])"
    )


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default process group, on the current accelerator or CPU."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed: call dist.init_process_group() first "
            "(torchrun sets up the environment), or pass mesh="
        )
    device_type = "cpu"
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        if current is not None and dist.get_backend() != "gloo":
            device_type = current.type
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _root_modules(module: nn.Module | Sequence[nn.Module]) -> tuple[nn.Module, ...]:
    if isinstance(module, nn.Module):
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and (
            type(module).forward is nn.Module.forward
        ):
            kind = type(module).__name__
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: "
                f"this {kind} has no forward of its own, so the hooks that all-gather its "
                "parameters would never run. Shard its parent module, or pass its modules "
                f"as a list to form one group: fully_shard(list({kind.lower()}"
                f"{'.values()' if isinstance(module, nn.ModuleDict) else ''}))"
            )
        return (module,)
    modules = list(module)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise ValueError("fully_shard expects an nn.Module or a non-empty list of nn.Modules")
    roots = []
    for m in modules:
        if not any(
            m is not other and any(m is sub for sub in other.modules()) for other in modules
        ):
            roots.append(m)
    return tuple(roots)


def _check_reshard_after_forward(value: Any) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        return  # validated against the mesh by the core's validation hook
    raise ValueError(f"reshard_after_forward must be None, a bool or an int, got {value!r}")


def _trivial_int_as_bool(
    value: bool | int | None, mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None
) -> bool | int | None:
    """``reshard_after_forward=1`` means ``False`` and ``=<shard group size>`` means ``True``
    (as in FSDP2): regrouping after forward to one rank, or to the whole shard group, is
    the same as keeping the parameters unsharded or resharding them fully."""
    if isinstance(value, bool) or not isinstance(value, int) or dp_mesh_dims is not None:
        return value
    if value == 1:
        return False
    if value == mesh.size(mesh.ndim - 1):  # the shard dim is the last (FSDP and HSDP)
        return True
    return value


def _collect_params(modules: tuple[nn.Module, ...], ignored: set[nn.Parameter]):
    """Parameters this call manages, with every (module, name) registration of each.

    Submodules that are already units are skipped (their parameters are theirs); a
    parameter registered both in such a unit and in a module this call manages is
    shared between units, which cannot work: it is reported with both names.
    """
    sub_states: list[Any] = []
    sub_params: dict[int, str] = {}
    named: list[tuple[str, nn.Parameter]] = []
    registrations: dict[int, list[tuple[nn.Module, str]]] = {}
    multi = len(modules) > 1

    def visit(module: nn.Module, prefix: str) -> None:
        state = getattr(module, "_hyperfsdp_state", None)
        if state is not None and prefix is not None and module not in modules:
            if state not in sub_states:
                sub_states.append(state)
            _name_sub_unit_params(module, prefix, state, sub_params)
            return
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if param is None or param in ignored:
                continue
            fqn = f"{prefix}{name}"
            if id(param) not in registrations:
                registrations[id(param)] = []
                named.append((fqn, param))
            registrations[id(param)].append((module, name))
        for child_name, child in module.named_children():
            visit(child, f"{prefix}{child_name}.")

    for i, m in enumerate(modules):
        visit(m, f"[{i}]." if multi else "")
    shared = [(fqn, sub_params.get(id(p)) or RETIRED.get(p)) for fqn, p in named]
    shared = [(fqn, other) for fqn, other in shared if other is not None]
    if shared:
        pairs = "; ".join(f"{a!r} is also {b!r} of another unit" for a, b in shared)
        raise ValueError(
            f"fully_shard: parameters shared with a submodule's fully_shard unit ({pairs}). "
            "A parameter must belong to one unit: put the modules that share it in one "
            "unit, e.g. fully_shard([embedding, output]), or shard their common parent"
        )
    return named, registrations, sub_states


def _name_sub_unit_params(module: nn.Module, prefix: str, state: Any, names: dict) -> None:
    """Name, from this call's module, the parameters that the sub-unit ``state`` manages
    under ``module`` (one of its modules, met at ``prefix``), in ``names`` (by the identity
    of the sharded and of the replaced parameter), and give the replaced ones that name:
    ``fully_shard(model.layers[0])`` knew ``weight``, the root's call knows
    ``layers.0.weight``, which errors about an optimizer built too early then show."""
    if state.group is None:
        return
    paths = {id(m): path for path, m in module.named_modules(remove_duplicate=False)}
    for hp in state.group.params:
        for owner, name in hp.module_infos:
            path = paths.get(id(owner))
            if path is not None:
                fqn = f"{prefix}{path}.{name}" if path else f"{prefix}{name}"
                names[id(hp.sharded_param)] = names[hp.orig_param_id] = fqn
                RETIRED.rename(hp.orig_param_id, fqn)
                break


def _shard_dim(unit: UnitSpec, fqn: str, param: nn.Parameter) -> int:
    if param.ndim == 0:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a scalar (0-d); FSDP shards along a dim. "
            "Give it shape (1,), or pass it in ignored_params="
        )
    placement = unit.shard_placement_fn(param) if unit.shard_placement_fn is not None else None
    if placement is None:
        return 0
    dim = getattr(placement, "dim", None)
    if dim is None:
        raise ValueError(
            f"shard_placement_fn returned {placement!r} for {fqn!r}; expected Shard(dim) or None"
        )
    dim = dim + param.ndim if dim < 0 else dim
    if not 0 <= dim < param.ndim:
        raise ValueError(
            f"shard_placement_fn returned Shard({placement.dim}) for {fqn!r} of shape "
            f"{tuple(param.shape)}, which has no dim {placement.dim}: return Shard(d) with "
            f"-{param.ndim} <= d < {param.ndim}, or None to shard dim 0"
        )
    return dim


def _check_even(fqn: str, tensor: torch.Tensor, dim: int, world: int) -> None:
    if dim != 0 and tensor.shape[dim] % world != 0:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} of shape {tuple(tensor.shape)} cannot be sharded "
            f"on dim {dim} over {world} ranks: {tensor.shape[dim]} is not divisible by {world}. "
            "Only dim 0 may be uneven; shard on dim 0 (return None from shard_placement_fn) "
            "or pick a dim whose size divides evenly"
        )


def _initial_local(hp: ShardedParam, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if hp.extension:  # the all-gather extension's subclass stays one (no detach)
        return initial_local(hp, tensor, device)
    data = tensor.detach()
    if data.device.type == "meta":
        return torch.empty(hp.layout.actual_shape, dtype=data.dtype, device="meta")
    local = hp.local_shard_of(data)
    return local.to(device)


def _move_managed_buffers(modules, sub_states, device) -> None:
    skip = {id(m) for s in sub_states for m in s.modules}

    def visit(module: nn.Module) -> None:
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device and buf.device.type != "meta":
                module._buffers[name] = buf.to(device)
        for child in module.children():
            if id(child) not in skip:
                visit(child)

    for m in modules:
        visit(m)


# -- other public functions --------------------------------------------------------------------


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run the unit's forward hooks around ``module.<method_name>`` too (no-op if not sharded)."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    orig = getattr(module, method_name)
    state = module._fsdp_state()

    def wrapped(*args, **kwargs):
        args, kwargs = state.pre_forward(module, args, kwargs)
        out = orig(*args, **kwargs)
        return state.post_forward(module, args, out)

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: Sequence[FSDPModule]) -> None:
    """Let several roots (e.g. pipeline stages) share one communication context."""
    modules = list(modules)
    if not modules:
        return
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"share_comm_ctx expects FSDPModules, got {type(m).__name__}")
    states = [m._fsdp_state() for m in modules]
    first = states[0].comm
    comm = first if first is not None and not first.provisional else Comm(states[0].device)
    for state in states:
        state.use_comm(comm)
        if state.ctx is not None:
            state.ctx.set_comm(comm)
