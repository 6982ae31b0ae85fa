"""torchao's weights on the all-gather extension (CPU, gloo): float8 training with
``enable_fsdp_float8_all_gather=True`` (with and without
``precompute_float8_dynamic_scale_for_fsdp``) and int8 mixed-precision training train
as torch's FSDP2 does on the same script, the float8 all-gathers move float8 bytes (the
collective observer's count equals FSDP2's), and an uneven dim-0 float8 weight -- which
FSDP2's float8 all-gather cannot shard -- trains as a single process does.

torchao is not a dependency of hyperfsdp: these tests run where it is installed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyperfsdp_core.testing import registered
from hyperfsdp_core.testing.counting import ObservedBytes, TorchCollectiveBytes

pytest.importorskip("torchao")

STEPS = 4
D_IN, HIDDEN, D_OUT = 32, 64, 16


def build(recipe: str, rows: int) -> nn.Module:
    """Three linears (the last in the root unit); ``rows``: the middle one's outputs."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(D_IN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, rows),
        nn.ReLU(),
        nn.Linear(rows, D_OUT),
    )
    if recipe.startswith("float8"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        gather = recipe != "float8_plain"
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=gather)
        convert_to_float8_training(model, config=config)
    elif recipe == "int8_mixed":
        from torchao import quantize_
        from torchao.prototype.quantized_training import int8_mixed_precision_training

        quantize_(model, int8_mixed_precision_training())
    return model


def rank_train(engine: str, recipe: str, rows: int, world: int = 0) -> dict:
    """Train; ``engine="single"``: one process on the global batch of ``world`` ranks."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    world, rank = world or dist.get_world_size(), dist.get_rank()
    precompute = recipe == "float8_precompute"
    model = build(recipe, rows)
    if engine != "single":
        if engine == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            from hyperfsdp_core import fully_shard
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    observed, gathered = ObservedBytes(), TorchCollectiveBytes()
    losses = []
    with registered(observed, "observed"), gathered:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8 * world, D_IN, generator=g)
            if engine != "single":
                loss = model(x.chunk(world)[rank]).pow(2).mean()
            else:  # each rank's micro-batch on its own: float8 scales its activations per batch
                loss = sum(model(part).pow(2).mean() for part in x.chunk(world)) / world
            loss.backward()
            opt.step()
            opt.zero_grad()
            if precompute and engine != "single":
                precompute_float8_dynamic_scale_for_fsdp(model)
            avg = loss.detach().clone()
            if engine != "single":
                dist.all_reduce(avg)
                avg /= world
            losses.append(avg.item())
    full = (lambda t: t.full_tensor()) if engine != "single" else (lambda t: t)
    local = model[2].weight.to_local() if engine != "single" else None
    return {
        "losses": losses,
        "params": {n: full(p.detach()).float().clone() for n, p in model.named_parameters()},
        "local_type": type(local).__name__,
        "observed": observed.bytes["all_gather"],
        "fsdp2": gathered.bytes["all_gather"],
    }


def float8_payload(rows: int, world: int) -> int:
    """All-gather bytes of one step: float8 weights (one byte per padded element; the
    scale, all-reduced in ``fsdp_pre_all_gather``, is metadata), fp32 biases; the blocks
    gather in forward and backward, the root once."""
    pad = -(-rows // world) * world
    weights = 2 * HIDDEN * D_IN + 2 * pad * HIDDEN + D_OUT * rows
    biases = 4 * (2 * HIDDEN + 2 * pad + D_OUT)
    return weights + biases


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("recipe", ["float8", "float8_precompute"])
def test_float8_all_gather_as_fsdp2(run_ranks, world, recipe):
    """Losses and parameters equal FSDP2's; the sharded weights stay torchao's subclass;
    the observer counts FSDP2's all-gather bytes, float8 ones (about a quarter of fp32)."""
    ours = run_ranks(world, rank_train, "hyperfsdp", recipe, HIDDEN, timeout=600)
    fsdp2 = run_ranks(world, rank_train, "fsdp2", recipe, HIDDEN, timeout=600)
    plain = run_ranks(world, rank_train, "hyperfsdp", "float8_plain", HIDDEN, timeout=600)
    for o, f, p in zip(ours, fsdp2, plain, strict=True):
        torch.testing.assert_close(o["losses"], f["losses"])
        for name, value in f["params"].items():
            torch.testing.assert_close(o["params"][name], value, msg=name)
        assert o["local_type"] == f["local_type"] == "WeightWithDynamicFloat8CastTensor"
        assert o["observed"] == f["fsdp2"] == STEPS * float8_payload(HIDDEN, world)
        assert o["observed"] < 0.3 * p["observed"]  # fp32 all-gathers without the extension


@pytest.mark.parametrize("world", [2, 4])
def test_int8_mixed_precision_as_fsdp2(run_ranks, world):
    ours = run_ranks(world, rank_train, "hyperfsdp", "int8_mixed", HIDDEN, timeout=600)
    fsdp2 = run_ranks(world, rank_train, "fsdp2", "int8_mixed", HIDDEN, timeout=600)
    for o, f in zip(ours, fsdp2, strict=True):
        torch.testing.assert_close(o["losses"], f["losses"])
        for name, value in f["params"].items():
            torch.testing.assert_close(o["params"][name], value, msg=name)
        assert o["local_type"] == f["local_type"] == "Int8MixedPrecisionTrainingLinearWeight"
        assert o["observed"] == f["fsdp2"]


@pytest.mark.parametrize(("world", "rows"), [(2, 17), (4, 18)])
@pytest.mark.parametrize("recipe", ["float8", "float8_precompute"])
def test_uneven_float8_weight_trains(run_ranks, world, rows, recipe):
    """Dim 0 not divisible by the world (FSDP2's float8 all-gather asserts there): trains
    as one process with the same float8 recipe on the global batch, moving float8 bytes
    (the padded rows' too)."""
    ours = run_ranks(world, rank_train, "hyperfsdp", recipe, rows, timeout=600)
    (ref,) = run_ranks(1, rank_train, "single", "float8_plain", rows, world, timeout=600)
    for o in ours:
        torch.testing.assert_close(o["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        for name, value in ref["params"].items():
            torch.testing.assert_close(o["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert o["observed"] == STEPS * float8_payload(rows, world)


def rank_tensor_parallel(engine: str, precompute: bool) -> list:
    """float8 with torchao's tensor-parallel styles on a (dp 2, tp 2) mesh, sharded over
    dp. With tensor parallelism the precomputed scale (amax over the whole weight) differs
    from the dynamic one (amax over the dp group), so the losses show which was used."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from hyperfsdp_core import fully_shard
    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D_IN))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)
    parallelize_module(
        model, mesh["tp"], {"0": Float8ColwiseParallel(), "2": Float8RowwiseParallel()}
    )
    fully_shard(model[0], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = mesh["dp"].get_local_rank()
    losses = []
    for step in range(STEPS):
        x = torch.randn(16, D_IN, generator=torch.Generator().manual_seed(step)).chunk(2)[dp]
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    return losses + [p.detach().full_tensor().float() for p in model.parameters()]


@pytest.mark.parametrize("precompute", [False, True])
def test_float8_tensor_parallel_as_fsdp2(run_ranks, precompute):
    ours = run_ranks(4, rank_tensor_parallel, "hyperfsdp", precompute, timeout=600)
    fsdp2 = run_ranks(4, rank_tensor_parallel, "fsdp2", precompute, timeout=600)
    for o, f in zip(ours, fsdp2, strict=True):
        torch.testing.assert_close(o, f)
