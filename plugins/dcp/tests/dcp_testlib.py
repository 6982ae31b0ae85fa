"""Models, training steps and comparisons shared by the hyperfsdp-dcp tests (public API only).

Rank functions run in the persistent rank processes of ``hyperfsdp_core.testing``; they
build a sharded model and an unsharded reference from the same seed, train the reference on
the global batch and each rank on its slice, and compare.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hyperfsdp_core import FSDPModule, fully_shard, get_plugin_manager, hookimpl
from hyperfsdp_core.testing.reference import (
    MLPStack,
    Transformer,
    full,
    lm_loss,
    token_batch,
)

# Uneven on purpose: at world 4, 3 rows shard as 1/1/1/0 and 2 rows as 1/1/0/0.
MLP_DIMS = [5, 7, 3, 6, 2]
GLOBAL_BATCH = 8
VOCAB = 23


class MixedInner(nn.Module):
    """fp32 and bf16 parameters in one unit, plus a frozen fp32 parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3).to(torch.bfloat16)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x))
        return self.b(h.to(torch.bfloat16)).float() * self.scale


class MixedFrozen(nn.Module):
    # The frozen parameter lives in a sub-unit: a frozen parameter in the root unit trips
    # the core's root prefetch hook (reported with issue 13).
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MixedInner()])
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layers[0](x))


def build(kind: str, seed: int = 0, device: str | None = None) -> nn.Module:
    torch.manual_seed(seed)
    ctx = torch.device(device) if device else _nullcontext()
    with ctx:
        if kind == "mlp":
            return MLPStack(MLP_DIMS)
        if kind == "tied":  # tied embedding/head, a frozen norm
            model = Transformer(vocab=VOCAB, dim=8, n_layers=2, n_heads=2, hidden=13, tied=True)
            model.layers[0].attn_norm.weight.requires_grad_(False)
            return model
        if kind == "mixed":
            return MixedFrozen()
    raise ValueError(kind)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def shard(model: nn.Module, mesh: Any = None, engine: Callable = fully_shard) -> nn.Module:
    """Shard each block, then the root (hyperfsdp by default; torch FSDP2 with ``engine=``)."""
    for block in getattr(model, "layers", ()):
        engine(block, mesh=mesh)
    engine(model, mesh=mesh)
    return model


def make_mesh(layout: str):
    """``"fsdp"``: 1-D over all ranks; ``"hsdp"``: (2, world // 2) (replicate, shard)."""
    if layout == "fsdp":
        return init_device_mesh("cpu", (dist.get_world_size(),))
    world = dist.get_world_size()
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


# -- data and steps -----------------------------------------------------------------------------


def batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "tied":
        return token_batch(step, GLOBAL_BATCH, 5, VOCAB)
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 5, generator=g)
    return x, x


def loss_of(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(out, y) if kind == "tied" else out.float().pow(2).mean()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def train_step(kind: str, model, opt, step: int, *, sharded: bool = True) -> float:
    """One optimizer step; returns the global-batch loss (averaged over ranks when sharded)."""
    x, y = batch(kind, step)
    if sharded:
        x, y = local(x), local(y)
    loss = loss_of(kind, model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    value = loss.detach().float().clone()
    if sharded:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def trained(kind: str, steps: int, mesh: Any = None, engine: Callable = fully_shard):
    """A sharded model and its unsharded reference, trained ``steps`` steps in lockstep."""
    model = build(kind)
    ref = copy.deepcopy(model)
    shard(model, mesh, engine)
    opt, ref_opt = optimizer(model), optimizer(ref)
    for step in range(steps):
        train_step(kind, model, opt, step)
        train_step(kind, ref, ref_opt, step, sharded=False)
    return model, opt, ref, ref_opt


def reference(kind: str, steps: int):
    ref = build(kind)
    ref_opt = optimizer(ref)
    for step in range(steps):
        train_step(kind, ref, ref_opt, step, sharded=False)
    return ref, ref_opt


# -- comparisons --------------------------------------------------------------------------------


def full_state(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Every parameter, buffer and optimizer state value, unsharded, keyed as DCP keys them."""
    from hyperfsdp_dcp._state import flatten  # the same flattening the plugin validates with

    opts = [opt] if opt is not None else []
    msd, osd = get_state_dict(model, opts, options=StateDictOptions(full_state_dict=True))
    out = {"model": msd}
    if opt is not None:
        out["optim"] = osd
    return {
        k: (full(v).detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
        for k, v in flatten(out).items()
    }


def assert_bitwise(a: dict[str, Any], b: dict[str, Any], what: str = "") -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())}"
    bad = []
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not (
                isinstance(y, torch.Tensor)
                and x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(x, y)
            ):
                bad.append(k)
        elif _plain(x) != _plain(y):
            bad.append(k)
    assert not bad, f"{what}: not bitwise equal: {bad}"


def _plain(value: Any) -> Any:
    """Tuples and lists alike (torch's broadcast of optimizer hyperparameters turns one into
    the other)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def assert_params_close(model: nn.Module, ref: nn.Module, atol=1e-5, rtol=1e-4) -> None:
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            full(p.detach()).float(),
            full(ref_params[name].detach()).float(),
            atol=atol,
            rtol=rtol,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def assert_close_loss(a: float, b: float, tol: float = 1e-5) -> None:
    assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), f"loss {a} != reference {b}"


def local_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {
        n: tuple(p.to_local().shape) for n, p in model.named_parameters() if isinstance(p, DTensor)
    }


# -- observing the core's storage rebuild (public hook) -----------------------------------------


class ResetRecorder:
    """A throwaway plugin recording ``hyperfsdp_param_reset``: the core rebuilt a parameter's
    padded communication storage (zero tails) around its loaded shard."""

    def __init__(self) -> None:
        self.fqns: list[str] = []
        self.nonzero_padding: list[str] = []

    @hookimpl
    def hyperfsdp_param_reset(self, param) -> None:
        self.fqns.append(param.fqn)
        padding = param.padded_shard().narrow(
            0, param.local_shape[0], param.padded_shape[0] - param.local_shape[0]
        )
        if padding.count_nonzero():
            self.nonzero_padding.append(param.fqn)

    def __enter__(self) -> ResetRecorder:
        get_plugin_manager().register(self, name=f"dcp-test-reset-{id(self)}")
        return self

    def __exit__(self, *exc: object) -> None:
        get_plugin_manager().unregister(self)


def assert_all_reset(model: nn.Module, resets: ResetRecorder) -> None:
    """Every managed parameter was reset exactly once with zero padding (the hook names a
    parameter relative to its unit before the first forward; a tied parameter may be named
    by any of its aliases)."""
    assert resets.nonzero_padding == []
    reset_fqns = resets.fqns
    units = [name + "." for name, m in model.named_modules() if name and isinstance(m, FSDPModule)]

    def relative(fqn: str) -> str:
        prefix = max((u for u in units if fqn.startswith(u)), key=len, default="")
        return fqn[len(prefix) :]

    aliases: dict[int, set[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), set()).add(relative(fqn))
    groups = list(aliases.values())
    assert len(reset_fqns) == len(model.sharding_plan()) == len(groups), (reset_fqns, groups)
    for names in groups:
        hits = [f for f in reset_fqns if f in names]
        assert len(hits) >= 1, f"{sorted(names)} was not reset: {reset_fqns}"


# -- checkpoint metadata ------------------------------------------------------------------------


def chunk_report(path) -> dict[str, tuple[int, int, bool]]:
    """Per stored tensor: (global numel, sum of chunk numels, chunks disjoint and in bounds)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(path).read_metadata()
    out = {}
    for key, tmd in md.state_dict_metadata.items():
        if not isinstance(tmd, TensorStorageMetadata):
            continue
        numel = math.prod(tmd.size)
        covered = torch.zeros(tuple(tmd.size), dtype=torch.int32)
        total = 0
        for chunk in tmd.chunks:
            total += math.prod(chunk.sizes)
            region = covered
            for dim, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes)):
                region = region.narrow(dim, o, s)
            region += 1
        ok = bool((covered == 1).all()) if numel else True
        out[key] = (numel, total, ok)
    return out
