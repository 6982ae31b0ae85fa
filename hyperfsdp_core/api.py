"""fully_shard() and the other public entry points."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._torch_private import expose_fsdp2_state
from .comm import Comm
from .comm.exit import install_exit_drain
from .engine.extension import initial_local
from .engine.mesh_info import check_mesh_device, mesh_device
from .engine.options import UnitOptions
from .engine.param import ShardedParam
from .engine.pipelining import StageReduceView
from .engine.spec import UnitSpec
from .engine.state import UnitState
from .engine.unit_params import UnitParams
from .module import FSDPModule, fsdp_class
from .plugin.dispatch import DISPATCH
from .plugin.manager import get_plugin_manager
from .policies import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy

install_exit_drain()  # gloo workers finish with the GIL before finalization (see _exit.py)

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
    :class:`FSDPModule`), or the list when given a list.
    """
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
    ignored = set(ignored_params or ())
    named, registrations, sub_states = _collect_params(modules, ignored)
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
    pm = get_plugin_manager()
    hook = pm.hook
    hook.hyperfsdp_validate_unit(unit=unit)
    # Decide everything before touching the module.
    storage = hook.hyperfsdp_sharded_storage(unit=unit)
    if storage is None and type(offload_policy) is not OffloadPolicy:
        raise ImportError(
            f"offload_policy={offload_policy!r} needs a plugin that places sharded storage "
            "(none installed answered hyperfsdp_sharded_storage): pip install hyperfsdp[offload]"
        )
    decisions = []
    for fqn, param in named:
        mesh_info = hook.hyperfsdp_select_mesh_info(unit=unit, fqn=fqn, param=param)
        shard_dim = _shard_dim(unit, fqn, param)
        layout = hook.hyperfsdp_param_layout(
            unit=unit, fqn=fqn, param=param, mesh_info=mesh_info, shard_dim=shard_dim
        )
        _check_even(fqn, layout.tensor, shard_dim, mesh_info.shard_size)
        dtypes = hook.hyperfsdp_param_dtypes(unit=unit, param=param) or (None, None)
        decisions.append((fqn, param, mesh_info, shard_dim, layout, dtypes))
    mixins: list[type] = []
    for result in hook.hyperfsdp_module_mixins(unit=unit):
        for mixin in result or ():
            if mixin not in mixins:
                mixins.append(mixin)

    device = mesh_device(mesh)
    hsdp_params, locals_by_param = [], {}
    for fqn, param, mesh_info, shard_dim, layout, (param_dtype, reduce_dtype) in decisions:
        hp = ShardedParam(
            fqn, param, layout, registrations[id(param)], mesh_info, shard_dim, DISPATCH
        )
        hp.set_dtypes(param_dtype, reduce_dtype)
        locals_by_param[id(hp)] = _initial_local(hp, layout.tensor, device)
        hsdp_params.append(hp)
        _RETIRED.add(param, fqn)
    _move_managed_buffers(modules, sub_states, device)
    group = UnitParams(hsdp_params, device, storage, mp_policy) if hsdp_params else None
    if group is not None:
        group.build_sharded(locals_by_param, _storage_device(locals_by_param.values(), device))
        if not isinstance(reshard_after_forward, bool) and isinstance(reshard_after_forward, int):
            group.post_forward_size = reshard_after_forward
            group.apply_settings()
    options = UnitOptions(
        reshard_after_forward=True if reshard_after_forward is None else reshard_after_forward,
        auto_reshard_after_forward=reshard_after_forward is None,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        # the call's options for hooks asked again later (dtypes after a conversion),
        # without the original parameters (their full tensors would stay alive)
        unit_spec=attrs.evolve(unit, named_params=(), replicate_params=frozenset()),
        unit_fqns=tuple(fqn for fqn, _ in named),
    )
    UnitState(modules, group, device, options, DISPATCH)
    for m in modules:
        # torch.distributed.pipelining reads a stage's FSDP2 state (see engine/pipelining.py)
        expose_fsdp2_state(m, StageReduceView(m))
        m.__class__ = fsdp_class(type(m), tuple(mixins))
        m.register_state_dict_pre_hook(_before_state_dict)
        m.register_load_state_dict_pre_hook(_convert_before_load)
        m.register_load_state_dict_post_hook(_reset_after_load)
    _install_optimizer_check()
    return module


# -- helpers ------------------------------------------------------------------------------------


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
                for hp in state.group.params if state.group is not None else ():
                    sub_params[id(hp.sharded_param)] = sub_params[hp.orig_param_id] = (
                        f"{prefix}{hp.fqn}"
                    )
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
    shared = [(fqn, sub_params.get(id(p)) or _RETIRED.get(p)) for fqn, p in named]
    shared = [(fqn, other) for fqn, other in shared if other is not None]
    if shared:
        pairs = "; ".join(f"{a!r} is also {b!r} of another unit" for a, b in shared)
        raise ValueError(
            f"fully_shard: parameters shared with a submodule's fully_shard unit ({pairs}). "
            "A parameter must belong to one unit: put the modules that share it in one "
            "unit, e.g. fully_shard([embedding, output]), or shard their common parent"
        )
    return named, registrations, sub_states


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


def _storage_device(locals_: Iterable[torch.Tensor], device: torch.device) -> torch.device:
    return torch.device("meta") if any(t.device.type == "meta" for t in locals_) else device


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


def _before_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    state = module._hyperfsdp_state  # type: ignore[attr-defined]
    if state.group is not None:
        state.group.reshard()
    get_plugin_manager().hook.hyperfsdp_state_dict_pre_save(unit=state.view)


def _convert_before_load(module: nn.Module, state_dict, prefix: str, *args) -> None:
    """Let plugins (and the core's default) convert incoming values of managed parameters."""
    state = module._hyperfsdp_state  # type: ignore[attr-defined]
    if state.group is None:
        return
    # the load copies into the registered parameters: the sharded ones, never unsharded
    # copies that the next reshard would drop
    state.group.reshard()
    ours = {id(p.sharded_param): p for p in state.group.params}
    convert = get_plugin_manager().hook.hyperfsdp_load_convert
    for name, param in module.named_parameters(remove_duplicate=False):
        p = ours.get(id(param))
        key = prefix + name
        if p is None or key not in state_dict:
            continue
        value = state_dict[key]
        if (
            isinstance(value, DTensor)
            and tuple(value.placements) == p.placements
            and value.device_mesh == p.dtensor_mesh
        ):
            continue
        converted = convert(param=p.view, value=value)
        if converted is not None:
            state_dict[key] = converted


def _reset_after_load(module: nn.Module, incompatible_keys) -> None:
    state = module._hyperfsdp_state  # type: ignore[attr-defined]
    if state.group is not None:
        state.reset_sharded_params()
    get_plugin_manager().hook.hyperfsdp_state_dict_post_load(unit=state.view)


# -- optimizer built before fully_shard ------------------------------------------------------------


class _RetiredParams:
    """Parameters fully_shard replaced, by identity (weakly held), with their FQN."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, str]] = {}

    def add(self, param: nn.Parameter, fqn: str) -> None:
        key = id(param)
        self._entries[key] = (weakref.ref(param, lambda _, k=key: self._entries.pop(k, None)), fqn)

    def get(self, param: Any) -> str | None:
        entry = self._entries.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None

    def __bool__(self) -> bool:
        return bool(self._entries)


_RETIRED = _RetiredParams()
_optimizer_hook_installed = False


def _install_optimizer_check() -> None:
    """Fail an optimizer step that would update parameters fully_shard replaced."""
    global _optimizer_hook_installed
    if _optimizer_hook_installed:
        return
    _optimizer_hook_installed = True

    def check(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if not _RETIRED:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                fqn = _RETIRED.get(p)
                if fqn is not None:
                    raise RuntimeError(
                        f"{type(optimizer).__name__} holds parameter {fqn!r} as it was before "
                        "fully_shard replaced it with a sharded DTensor, so its step would not "
                        "train the model. Build the optimizer after fully_shard, from "
                        "model.parameters()"
                    )

    register_optimizer_step_pre_hook(check)


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
        state.comm = comm
        if state.ctx is not None:
            state.ctx.set_comm(comm)
