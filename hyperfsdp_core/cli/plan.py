"""``hyperfsdp plan``: how a model would be sharded, and what it costs per rank, before launch.

Works from shapes alone: the model is built on the meta device, nothing is allocated and
no process group is needed. Units follow the usual recipe (every element of an
``nn.ModuleList`` is a unit, the root takes the rest; or ``--units REGEX``), parameters
are sharded on dim 0 with ``torch.chunk`` semantics over the shard dimension of the mesh,
exactly as ``fully_shard`` does, so the per-rank byte counts are exact for the sharded
parameters, their gradients and the optimizer state.
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import sys
from collections.abc import Callable, Sequence

import attrs
import torch
from torch import nn

from ..engine.layout import ShardLayout

#: optimizer -> (state tensors per parameter, each the parameter's shape and dtype)
OPTIMIZER_STATE = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0, "none": 0}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@attrs.frozen
class UnitPlan:
    name: str  # "" for the root
    params: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # (fqn, shape, dtype)

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.params)


@attrs.frozen
class RankMemory:
    """Bytes one rank holds between steps (and the transient peak of one unit)."""

    rank: int  # rank along the shard dimension (replicas hold the same)
    params: int  # actual shards, original dtype
    padding: int  # communication padding of uneven shapes (never in checkpoints)
    grads: int  # sharded gradients, original dtype
    optimizer: int  # optimizer state tensors (per-parameter step counters not counted)
    largest_unit: str
    largest_unit_bytes: int  # unsharded parameters + their gradients, one unit

    @property
    def sharded_total(self) -> int:
        return self.params + self.padding + self.grads + self.optimizer


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """``package.module:callable`` -> the callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(
            f"hyperfsdp plan: expected MODULE:FACTORY (e.g. mypkg.models:build), got {spec!r}"
        )
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"hyperfsdp plan: cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SystemExit(f"hyperfsdp plan: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SystemExit(f"hyperfsdp plan: {spec!r} is not callable")
    return obj


def plan_units(model: nn.Module, units: str | None = None) -> list[UnitPlan]:
    """The units ``fully_shard`` would form, innermost first, the root last."""
    if units is None:
        chosen = []
        for name, module in model.named_modules():
            if isinstance(module, nn.ModuleList):
                chosen += [f"{name}.{c}" if name else c for c, _ in module.named_children()]
    else:
        pattern = re.compile(units)
        chosen = [name for name, _ in model.named_modules() if name and pattern.fullmatch(name)]
    # bottom-up: a unit owns the parameters no unit below it owns
    chosen.sort(key=lambda n: -n.count("."))
    owned: set[int] = set()
    plans = []
    modules = dict(model.named_modules())
    for name in [*chosen, ""]:
        params = []
        for fqn, p in modules[name].named_parameters(prefix=name):
            if id(p) not in owned:
                owned.add(id(p))
                params.append((fqn, tuple(p.shape), p.dtype))
        plans.append(UnitPlan(name, tuple(params)))
    return plans


def estimate(
    plans: Sequence[UnitPlan],
    shard_size: int,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
) -> list[RankMemory]:
    """Per shard rank: the bytes of sharded parameters, gradients, optimizer state, padding,
    and the largest unit's unsharded parameters plus gradients."""
    n_state = OPTIMIZER_STATE[optimizer]
    largest, largest_bytes = "", 0
    for unit in plans:
        unsharded = 0
        for _, shape, dtype in unit.params:
            compute = param_dtype if param_dtype is not None and dtype.is_floating_point else dtype
            reduce = (
                reduce_dtype if reduce_dtype is not None and dtype.is_floating_point else compute
            )
            n = math.prod(shape)
            unsharded += n * _size(compute) + n * _size(reduce)
        if unsharded > largest_bytes:
            largest, largest_bytes = unit.name or "<root>", unsharded
    out = []
    for rank in range(shard_size):
        params = padding = 0
        for unit in plans:
            for _, shape, dtype in unit.params:
                lay = ShardLayout(shape, 0, world=shard_size, rank=rank)
                params += lay.actual_numel * _size(dtype)
                if not lay.is_even:
                    padding += lay.padding_numel * _size(dtype)
        out.append(
            RankMemory(
                rank=rank,
                params=params,
                padding=padding,
                grads=params,
                optimizer=n_state * params,
                largest_unit=largest,
                largest_unit_bytes=largest_bytes,
            )
        )
    return out


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a mesh shape like 8 or 2x4, got {text!r}"
        ) from None
    if not 1 <= len(shape) <= 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"expected a 1-D (shard) or 2-D (replicate x shard) mesh shape, got {text!r}"
        )
    return shape


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="show how a model would be sharded and what each rank holds, before launching",
        description=(
            "Build MODEL (MODULE:FACTORY, called with no arguments) on the meta device, shard "
            "it as fully_shard would (each nn.ModuleList element a unit, then the root; or "
            "--units), and print per-parameter shard shapes; with --memory, each rank's bytes "
            "of sharded parameters, gradients and optimizer state and the largest unsharded "
            "unit. No process group and no memory are needed."
        ),
    )
    p.add_argument("model", metavar="MODULE:FACTORY", help="e.g. mypkg.models:build_llama")
    p.add_argument(
        "--mesh",
        type=_mesh_shape,
        default=(2,),
        help="data-parallel mesh: S (FSDP over S ranks) or RxS (HSDP: R replicas of S shards); default 2",
    )
    p.add_argument(
        "--units",
        metavar="REGEX",
        help="module names that are units (default: ModuleList elements)",
    )
    p.add_argument("--memory", action="store_true", help="per-rank memory estimate")
    p.add_argument("--param-dtype", choices=sorted(DTYPES), help="MixedPrecisionPolicy.param_dtype")
    p.add_argument(
        "--reduce-dtype", choices=sorted(DTYPES), help="MixedPrecisionPolicy.reduce_dtype"
    )
    p.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZER_STATE),
        default="adamw",
        help="state per parameter (default adamw)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    factory = load_factory(args.model)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        print(
            f"hyperfsdp plan: {args.model} returned {type(model).__name__}, not an nn.Module",
            file=sys.stderr,
        )
        return 2
    plans = plan_units(model, args.units)
    shard = args.mesh[-1]
    replicas = args.mesh[0] if len(args.mesh) == 2 else 1
    total = sum(u.numel for u in plans)
    kind = f"HSDP {replicas}x{shard}" if replicas > 1 else f"FSDP over {shard} ranks"
    print(f"{args.model}: {total:,} parameters in {len(plans)} units, {kind}")
    if not args.memory:
        width = max(len(fqn) for u in plans for fqn, _, _ in u.params)
        print(f"{'param'.ljust(width)}  {'unit':<12} {'global':<14} shard rows per rank")
        for unit in plans:
            for fqn, shape, _ in unit.params:
                rows = [ShardLayout(shape, 0, world=shard, rank=r).actual_len for r in range(shard)]
                shown = ",".join(map(str, rows)) if shard <= 8 else f"{rows[0]}..{rows[-1]}"
                glob = "x".join(map(str, shape))
                print(f"{fqn.ljust(width)}  {(unit.name or '<root>'):<12} {glob:<14} {shown}")
        return 0
    dtype = lambda name: DTYPES[name] if name else None  # noqa: E731
    ranks = estimate(
        plans,
        shard,
        param_dtype=dtype(args.param_dtype),
        reduce_dtype=dtype(args.reduce_dtype),
        optimizer=args.optimizer,
    )
    print(f"per rank (shard rank; {replicas} replica(s) each), optimizer {args.optimizer}:")
    print(
        f"  {'rank':>4}  {'params':>12}  {'grads':>12}  {'optimizer':>12}  {'padding':>10}  {'total':>12}"
    )
    for r in ranks:
        print(
            f"  {r.rank:>4}  {_mib(r.params):>12}  {_mib(r.grads):>12}  {_mib(r.optimizer):>12}  "
            f"{_mib(r.padding):>10}  {_mib(r.sharded_total):>12}"
        )
    worst = max(ranks, key=lambda r: r.sharded_total)
    print(
        f"largest unit: {worst.largest_unit} ({_mib(worst.largest_unit_bytes)} unsharded "
        "parameters + gradients while it runs; two units are unsharded at once with prefetch)"
    )
    peak = worst.sharded_total + 2 * worst.largest_unit_bytes
    print(f"estimate without activations: {_mib(peak)} on the busiest rank")
    return 0
