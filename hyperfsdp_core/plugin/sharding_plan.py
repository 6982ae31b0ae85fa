"""sharding_plan(): a readable, per-parameter view of how a model is sharded."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ..engine.param import ShardedParam
from .manager import get_plugin_manager


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@attrs.frozen
class PlanRow:
    """How one managed parameter is sharded on this rank."""

    fqn: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    padded_shape: tuple[int, ...]
    orig_dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    mesh_kind: str
    shard_size: int
    replicate_size: int
    needs_all_gather: bool
    storage_owner: str
    tp_replicate_axis: str | None
    #: plugins' columns (``hyperfsdp_plan_columns``), in the order they were given
    extra: tuple[tuple[str, Any], ...] = ()

    def column(self, name: str, default: Any = None) -> Any:
        """A plugin column's value for this row."""
        return dict(self.extra).get(name, default)

    @classmethod
    def of(cls, p: ShardedParam, owner: str, fqn: str, extra: dict[str, Any]) -> PlanRow:
        return cls(
            fqn=fqn,
            global_shape=p.global_shape,
            local_shape=p.layout.actual_shape,
            padded_shape=p.layout.padded_shape,
            orig_dtype=p.orig_dtype,
            param_dtype=p.param_dtype,
            reduce_dtype=p.reduce_dtype,
            mesh_kind=p.mesh_info.kind,
            shard_size=p.mesh_info.shard_size,
            replicate_size=p.mesh_info.replicate_size,
            needs_all_gather=p.needs_all_gather,
            storage_owner=owner,
            tp_replicate_axis=extra.get("tp_replicate_axis"),
            extra=tuple(extra.items()),
        )


_COLUMNS = (
    ("fqn", "param"),
    ("global_shape", "global"),
    ("local_shape", "local"),
    ("padded_shape", "padded"),
    ("dtypes", "orig/param/reduce"),
    ("mesh", "mesh"),
    ("needs_all_gather", "all-gather"),
    ("storage_owner", "unsharded storage"),
)


class ShardingPlan(tuple[PlanRow, ...]):
    """The rows of :meth:`FSDPModule.sharding_plan`; ``str()`` gives a table."""

    def __str__(self) -> str:
        def cell(row: PlanRow, key: str) -> str:
            if key == "dtypes":
                return "/".join(
                    _dtype_name(d) for d in (row.orig_dtype, row.param_dtype, row.reduce_dtype)
                )
            if key == "mesh":
                return f"{row.mesh_kind} s={row.shard_size} r={row.replicate_size}"
            value = getattr(row, key)
            if isinstance(value, tuple):
                return "x".join(map(str, value)) or "()"
            if isinstance(value, bool):
                return "yes" if value else "no"
            return str(value)

        extra = list(dict.fromkeys(k for row in self for k, _ in row.extra))

        def extra_cell(row: PlanRow, key: str) -> str:
            value = row.column(key)
            return "-" if value is None else str(value)

        table = [[title for _, title in _COLUMNS] + extra]
        table += [
            [cell(row, key) for key, _ in _COLUMNS] + [extra_cell(row, k) for k in extra]
            for row in self
        ]
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def sharding_plan(module) -> ShardingPlan:
    """Rows for every managed parameter under ``module``, FQNs relative to it."""
    named = list(module.named_parameters(remove_duplicate=False))
    names: dict[int, str] = {}
    for n, p in named:  # a tied parameter: its first alias, as named_parameters() gives
        names.setdefault(id(p), n)
    order = {n: i for i, (n, _) in enumerate(named)}
    rows: list[PlanRow] = []
    seen: set[int] = set()
    columns = get_plugin_manager().hook.hyperfsdp_plan_columns
    for sub in module.modules():
        state = getattr(sub, "_hyperfsdp_state", None)
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        if state.group is None:
            continue
        for bucket in state.group.buckets:
            owner = str(bucket.storage_owner)
            for p in bucket.params:
                fqn = names.get(id(p.sharded_param)) or names.get(id(p.unsharded_param), p.fqn)
                extra: dict[str, Any] = {}
                for result in reversed(columns(param=p.view)):  # first registered first
                    extra.update(result or {})
                rows.append(PlanRow.of(p, owner, fqn, extra))
    rows.sort(key=lambda row: order.get(row.fqn, len(order)))
    return ShardingPlan(rows)
