"""Lightning Fabric's ``ModelParallelStrategy`` (FSDP2 through a user ``parallelize_fn`` that
calls torch's ``fully_shard``) shards with hyperfsdp through ``use_as_fsdp2()`` and gives torch
FSDP2's losses and gradient norms on a tiny HF Llama.

Lightning and transformers are not dependencies: the tests skip without them. Fabric runs on
the harness's gloo ranks as it would under ``torchrun``: ``LOCAL_RANK`` and friends in the
environment make Lightning treat the processes as launched externally and join the existing
process group, on ``accelerator="cpu"``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

from _tiny_llama import tiny_llama, token_batch

STEPS = 5


def parallelize(model, device_mesh, mixed_precision: bool):
    """The ``parallelize_fn`` as Lightning's docs write it: torch's names, imported when it
    runs (the switch decides whose they are)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    return _shard(model, device_mesh, mixed_precision, fully_shard, MixedPrecisionPolicy)


def parallelize_with_hyperfsdp(model, device_mesh, mixed_precision: bool):
    """The same ``parallelize_fn`` importing hyperfsdp's names instead (no switch)."""
    from hyperfsdp_core import MixedPrecisionPolicy, fully_shard

    return _shard(model, device_mesh, mixed_precision, fully_shard, MixedPrecisionPolicy)


def _shard(model, device_mesh, mixed_precision, fully_shard, policy_class):
    import torch

    mp = policy_class(param_dtype=torch.bfloat16) if mixed_precision else None
    kwargs = {"mesh": device_mesh["data_parallel"]}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def train(route: str, mixed_precision: bool, tied: bool) -> dict:
    """Five AdamW steps of two micro-batches each (the first under Fabric's
    ``no_backward_sync``), ``fabric.backward`` and ``fabric.clip_gradients``. ``route``:
    ``"switch"`` (torch's names under ``use_as_fsdp2()``), ``"import"`` (the
    ``parallelize_fn`` imports hyperfsdp's), ``"fsdp2"`` (torch's own)."""
    import functools

    import torch
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    import hyperfsdp_core

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",  # unused: the process group already exists
    )
    switch = hyperfsdp_core.use_as_fsdp2() if route == "switch" else None
    fn = parallelize_with_hyperfsdp if route == "import" else parallelize
    try:
        strategy = ModelParallelStrategy(
            functools.partial(fn, mixed_precision=mixed_precision),
            data_parallel_size=world,
            tensor_parallel_size=1,
        )
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        model = fabric.setup_module(tiny_llama(tied))
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        inner = model.module if hasattr(model, "module") else model
        sharded_by = {
            type(m).__name__: hasattr(m, "_hyperfsdp_state")
            for m in inner.modules()
            if type(m).__name__.startswith("FSDP")
        }
        losses, norms = [], []
        for step in range(STEPS):
            tokens = token_batch(step, 4 * world)
            for micro in range(2):
                rows = slice(4 * rank + 2 * micro, 4 * rank + 2 * micro + 2)
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    loss = model(input_ids=tokens[rows], labels=tokens[rows]).loss / 2
                    fabric.backward(loss)
            norm = fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
            avg = loss.detach().float().clone()
            dist.all_reduce(avg)
            losses.append(avg.item() / world)
            norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
        return {"losses": losses, "norms": norms, "sharded_by": sharded_by}
    finally:
        if switch is not None:
            switch.restore()


def both(route: str, mixed_precision: bool, tied: bool):
    return train(route, mixed_precision, tied), train("fsdp2", mixed_precision, tied)


@pytest.mark.parametrize(
    ("route", "mixed_precision", "tied"),
    [("switch", False, False), ("switch", True, True), ("import", True, False)],
)
def test_fabric_model_parallel_strategy_gives_fsdp2_losses(run_ranks, route, mixed_precision, tied):
    for ours, theirs in run_ranks(2, both, route, mixed_precision, tied, timeout=600):
        assert ours["sharded_by"] and all(ours["sharded_by"].values()), ours["sharded_by"]
        assert not any(theirs["sharded_by"].values()), theirs["sharded_by"]
        assert ours["losses"] == theirs["losses"]  # bit for bit
        assert ours["norms"] == theirs["norms"]
        assert ours["losses"][-1] < ours["losses"][0]
