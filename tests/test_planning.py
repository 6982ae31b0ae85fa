"""``hyperfsdp plan``: the estimate from shapes alone equals what a sharded run holds."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from hyperfsdp_core import MixedPrecisionPolicy, fully_shard
from hyperfsdp_core.cli import main
from hyperfsdp_core.cli.plan import estimate, plan_units
from hyperfsdp_core.testing.reference import Transformer, lm_loss, local_slice, token_batch

FACTORY = "hyperfsdp_core.testing.reference:Transformer"  # vocab 37, hidden 27: uneven


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def rank_measure(mesh_shape, tied, bf16):
    torch.manual_seed(0)
    model = Transformer(n_layers=3, tied=tied)
    with torch.device("meta"):
        planned = plan_units(Transformer(n_layers=3, tied=tied))
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    world = torch.distributed.get_world_size()
    x, y = token_batch(0, 2 * world, 5, 37)
    lm_loss(model(local_slice(x)).float(), local_slice(y)).backward()
    opt.step()
    params = list(model.parameters())
    measured = {
        "params": sum(nbytes(p.to_local()) for p in params),
        "grads": sum(nbytes(p.grad.to_local()) for p in params),
        "optimizer": sum(
            nbytes(v.to_local())
            for p in params
            for k, v in opt.state[p].items()
            if k != "step"  # per-parameter step counters
        ),
        "padding": sum(
            (torch.Size(r.padded_shape).numel() - torch.Size(r.local_shape).numel())
            * torch.empty((), dtype=r.orig_dtype).element_size()
            for r in model.sharding_plan()
        ),
    }
    shard_rank = mesh.get_local_rank(mesh.ndim - 1)
    mine = estimate(planned, mesh_shape[-1], param_dtype=torch.bfloat16 if bf16 else None)[
        shard_rank
    ]
    predicted = {k: getattr(mine, k) for k in measured}
    units = [u.name for u in planned]
    return measured, predicted, units, mine.largest_unit


@pytest.mark.parametrize(
    ("mesh_shape", "tied", "bf16"),
    [((2,), False, False), ((4,), True, True), ((2, 2), False, False)],
)
def test_estimate_equals_the_live_bytes_of_a_sharded_run(run_ranks, mesh_shape, tied, bf16):
    world = 4 if len(mesh_shape) == 2 or mesh_shape[0] == 4 else 2
    results = run_ranks(world, rank_measure, mesh_shape, tied, bf16, timeout=120)
    for measured, predicted, units, largest in results:
        assert measured == predicted
        assert units == ["layers.0", "layers.1", "layers.2", ""]
        assert largest == "layers.0"  # a block (SwiGLU, attention) outweighs embedding + head
    assert len({r[0]["params"] for r in results}) > 1  # uneven: ranks really differ


def test_plan_memory_command(capsys):
    assert main(["plan", "--memory", FACTORY, "--mesh", "2x4"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        f"{FACTORY}: {sum(p.numel() for p in Transformer().parameters()):,} parameters in 3 "
        "units, HSDP 2x4"
    )
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert "largest unit: layers.0 " in out


def test_plan_lists_shard_rows_per_rank(capsys):
    assert main(["plan", FACTORY, "--mesh", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    emb = next(line for line in lines if line.startswith("tok_embeddings.weight"))
    assert emb.split() == ["tok_embeddings.weight", "<root>", "37x16", "10,10,10,7"]


def test_plan_rejects_a_bad_factory(capsys):
    with pytest.raises(SystemExit, match="expected MODULE:FACTORY"):
        main(["plan", "no_colon_here"])
    with pytest.raises(SystemExit, match="has no attribute 'Nope'"):
        main(["plan", "hyperfsdp_core.testing.reference:Nope"])
