"""Training equals torch's own FSDP2 bit for bit (gloo, CPU) at every world size.

Both engines train the same model on the same batches in one rank process, one after
the other; losses and final parameters are compared with ``torch.equal``. Worlds that
are not powers of two catch a division in the wrong place (``x * (1/3)`` before the sum
is not ``sum / 3`` after it). The gradient divisions are in ``hyperfsdp_core/_divide.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hyperfsdp_core.engine.divide import gradient_divisors
from hyperfsdp_core.testing import shared_memory
from hyperfsdp_core.testing.reference import Transformer, lm_loss, token_batch

STEPS = 6
VOCAB = 29


def _mesh(hsdp: tuple[int, int] | None):
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp is None:
        return init_device_mesh("cpu", (dist.get_world_size(),))
    return init_device_mesh("cpu", hsdp, mesh_dim_names=("replicate", "shard"))


def _train(engine: str, config: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from hyperfsdp_core import fully_shard

    torch.manual_seed(0)
    model = Transformer(vocab=VOCAB, dim=12, n_layers=2, n_heads=2, hidden=19)  # uneven shards
    mesh = _mesh(config.get("hsdp"))
    kwargs = {"mesh": mesh}
    if config.get("reduce_dtype") is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=config.get("param_dtype"), reduce_dtype=config["reduce_dtype"]
        )
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    factor = config.get("factor")
    if factor is not None:
        for unit in [*model.layers, model]:
            unit.set_gradient_divide_factor(factor)
            if engine == "fsdp2":  # gloo cannot run FSDP2's pre-multiplied sum otherwise
                unit.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for step in range(STEPS):
        x, y = token_batch(step, 2 * world, 5, VOCAB)
        loss = lm_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    params = [p.detach().to_local().clone() for p in model.parameters()]
    return losses, params, engine != "fsdp2" and _shared_memory_used(model)


def _shared_memory_used(model) -> bool:
    """Whether the hyperfsdp-shm transport of ``model``'s root made a shared-memory group."""
    from hyperfsdp_shm.plugin import ROOT_TRANSPORT

    from hyperfsdp_core.plugin import unit_of

    transport = unit_of(model).root.stash.get(ROOT_TRANSPORT, None)
    return transport is not None and any(g is not None for g in transport._shm.values())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def same_as_fsdp2(config: dict, shm: bool = False) -> dict:
    ref_losses, ref_params, _ = _train("fsdp2", config)
    with shared_memory(shm):
        losses, params, used_shm = _train("hyperfsdp", config)
    assert used_shm is shm  # the shared-memory reduce-scatter sums in gloo's order
    worst = max(  # some ranks hold empty shards at worlds 5 and 6
        (
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(params, ref_params)
            if a.numel()
        ),
        default=0.0,
    )
    return {
        "losses": all(torch.equal(_bits(a), _bits(b)) for a, b in zip(losses, ref_losses)),
        "params": all(torch.equal(_bits(a), _bits(b)) for a, b in zip(params, ref_params)),
        "worst param diff": worst,
    }


EXACT = {"losses": True, "params": True, "worst param diff": 0.0}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
def test_default_training_equals_fsdp2_bit_for_bit(run_ranks, world, shm):
    assert run_ranks(world, same_as_fsdp2, {}, shm) == [EXACT] * world


@pytest.mark.parametrize(
    "config",
    [
        {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
        {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16},
        {"param_dtype": None, "reduce_dtype": torch.float16},  # divided before and after
        {"factor": 5.0},  # the sum over 3 ranks, divided by 5
        {"factor": 3.0},  # the world size: FSDP2 averages in the collective
    ],
    ids=["bf16-params", "bf16-reduce", "fp16-reduce", "factor-5", "factor-3"],
)
def test_world_three_equals_fsdp2_bit_for_bit(run_ranks, config):
    assert run_ranks(3, same_as_fsdp2, config) == [EXACT] * 3


@pytest.mark.parametrize("world, hsdp", [(4, (2, 2)), (6, (2, 3)), (6, (3, 2))])
def test_hsdp_equals_fsdp2_bit_for_bit(run_ranks, world, hsdp):
    """FSDP2 averages over the shard group in the reduce-scatter, then over the replicas in
    the all-reduce: two divisions, at the same two points here."""
    assert run_ranks(world, same_as_fsdp2, {"hsdp": hsdp}) == [EXACT] * world


@pytest.mark.parametrize("world", [5, 6])
def test_worlds_five_and_six_equal_fsdp2_bit_for_bit(run_ranks, world):
    assert run_ranks(world, same_as_fsdp2, {}) == [EXACT] * world


def test_divisors_follow_fsdp2():
    """Where each division happens (the arithmetic the training tests check end to end)."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert gradient_divisors(3, 1, f32) == (None, 3.0, None)  # AVG: sum, then / 3
    assert gradient_divisors(3, 1, bf16, 3.0) == (None, 3.0, None)
    assert gradient_divisors(1, 1, f32) == (None, None, None)  # nothing to average
    assert gradient_divisors(1, 1, f32, 4.0) == (None, 4.0, None)
    assert gradient_divisors(2, 3, f32) == (None, 2.0, 3.0)  # RS AVG, then AR AVG
    assert gradient_divisors(2, 3, f32, 2.0) == (None, 2.0, None)  # RS AVG, then AR SUM
    assert gradient_divisors(1, 4, f32) == (None, None, 4.0)  # replicated: AR AVG
    # overflow-prone dtypes: a power of two before the sum, the rest after everything
    assert gradient_divisors(3, 1, f16) == (2.0, 1.5, None)
    assert gradient_divisors(4, 1, f16) == (2.0, 2.0, None)
    assert gradient_divisors(2, 3, f16) == (4.0, None, 1.5)  # FSDP2: 4 before, not 2
    assert gradient_divisors(8, 1, torch.float64) == (4.0, 2.0, None)
