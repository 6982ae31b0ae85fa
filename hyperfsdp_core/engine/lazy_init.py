"""A root's lazy init: at its first forward, the unit it runs through becomes the root of
every unit below it; their context, names, plans and resolved hooks are set up once."""

from __future__ import annotations

from torch import nn

from ..comm import Comm
from .root import RootContext, Unit


def init_root(root: Unit) -> RootContext:
    """Make ``root`` the root of every unit under its module; returns the context."""
    if len(root.modules) != 1:
        raise RuntimeError(
            "hyperfsdp: the first forward must run through the root module, not a list "
            "unit; apply fully_shard to the model's top module last"
        )
    root_module = root.modules[0]
    states, names = _units_under(root, root_module)
    # a tied parameter is named as named_parameters() names it: by its first alias
    param_fqns = {id(p): n for n, p in root_module.named_parameters()}
    for state in states:
        state.adopt_registered_params(param_fqns)
    check_materialized(states)
    comm = root.comm if root.comm is not None and not root.comm.provisional else Comm(root.device)
    ctx = RootContext(root, states, comm)
    for state in states:
        state.join_root(ctx, ", ".join(names[id(state)]))
    for state in states:
        state.prepare_for_root()
    ctx.use_hooks(root.port.root_hooks(ctx.view))
    return ctx


def _units_under(root: Unit, root_module: nn.Module) -> tuple[list[Unit], dict[int, list[str]]]:
    """The units under ``root_module`` in module order (the root first), and each one's
    module names."""
    states: list[Unit] = []
    names: dict[int, list[str]] = {}
    for name, module in root_module.named_modules():
        state = getattr(module, "_hyperfsdp_state", None)
        if state is None:
            continue
        if id(state) in names:
            names[id(state)].append(name)
            continue
        if state is not root and state.ctx is not None:
            raise RuntimeError(
                f"hyperfsdp: unit {name!r} was already initialized as part of another root; "
                "run the first forward through the top module"
            )
        names[id(state)] = [name]
        states.append(state)
    return states, names


def check_materialized(states: list[Unit]) -> None:
    """Fail a forward whose units still have parameters on the meta device, naming them."""
    on_meta = [
        p.fqn
        for state in states
        if state.group is not None
        for b in state.group.buckets
        if b.payload.on_meta()
        for p in b.params
    ]
    if on_meta:
        raise RuntimeError(
            f"hyperfsdp: {len(on_meta)} sharded parameter(s) are still on the meta device at "
            f"the first forward: {', '.join(on_meta)}. Materialize them before training: "
            "model.to_empty(device=...) allocates every shard on a real device, then "
            "initialize the values (e.g. call reset_parameters() on each module, or load a "
            "checkpoint)"
        )
