"""Hugging Face accelerate's real FSDP2 path (the one the transformers ``Trainer`` takes with
``FullyShardedDataParallelPlugin(fsdp_version=2)``) shards with hyperfsdp through
``use_as_fsdp2()`` and gives torch FSDP2's losses and gradient norms on a tiny HF Llama.

accelerate is not a dependency: the tests skip without it (and without transformers).

On a CPU-only host accelerate turns the FSDP plugin off: ``AcceleratorState`` takes the
plugin only for accelerator device types and otherwise leaves ``distributed_type`` at
``MULTI_CPU``, i.e. DDP. :func:`fsdp2_accelerator` therefore sets the two fields that
accelerate itself sets on an accelerator host (``distributed_type = FSDP``, ``fsdp_plugin``,
and the plugin's mixed precision, as ``AcceleratorState.__init__`` does) right after building
the ``Accelerator``; everything after it (``prepare`` -> ``fsdp2_prepare_model``,
``backward``, ``clip_grad_norm_``, the optimizer wrapper) is accelerate's own code, unchanged.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from _tiny_llama import tiny_llama, token_batch

STEPS = 5


def fsdp2_accelerator(mixed_precision: str):
    """An ``Accelerator`` on its FSDP2 path over the harness's gloo group (see the module
    docstring for the two fields set by hand on a CPU host)."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",  # unused: the process group already exists
        OMP_NUM_THREADS=str(torch.get_num_threads()),
    )
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
    )
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision, fsdp_plugin=plugin)
    state = AcceleratorState()
    assert state.distributed_type == DistributedType.MULTI_CPU  # accelerate dropped the plugin
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    assert accelerator.is_fsdp2
    return accelerator


def train(use_hyperfsdp: bool, mixed_precision: str, tied: bool, switch_first: bool) -> dict:
    """Five AdamW steps through accelerate: prepare, forward, backward, clip, step. With
    ``switch_first=False`` the FSDP plugin is built before ``use_as_fsdp2()``, so it holds
    torch's own policy objects (``OffloadPolicy()``, ``MixedPrecisionPolicy``)."""
    import torch
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    import hyperfsdp_core

    switch = hyperfsdp_core.use_as_fsdp2() if use_hyperfsdp and switch_first else None
    try:
        accelerator = fsdp2_accelerator(mixed_precision)
        plugin = accelerator.state.fsdp_plugin
        policies = [type(plugin.cpu_offload).__module__]
        if plugin.mixed_precision_policy is not None:
            policies.append(type(plugin.mixed_precision_policy).__module__)
        if use_hyperfsdp and not switch_first:
            switch = hyperfsdp_core.use_as_fsdp2()
        model = tiny_llama(tied)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = accelerator.prepare(model, opt)
        sharded_by = {
            type(m).__name__: hasattr(m, "_hyperfsdp_state")
            for m in model.modules()
            if type(m).__name__.startswith("FSDP")
        }
        rank, world = dist.get_rank(), dist.get_world_size()
        losses, norms = [], []
        for step in range(STEPS):
            tokens = token_batch(step, 2 * world)[2 * rank : 2 * rank + 2]
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            avg = loss.detach().float().clone()
            dist.all_reduce(avg)
            losses.append(avg.item() / world)
            norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
        return {"losses": losses, "norms": norms, "sharded_by": sharded_by, "policies": policies}
    finally:
        if switch is not None:
            switch.restore()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def both(mixed_precision: str, tied: bool, switch_first: bool):
    return (
        train(True, mixed_precision, tied, switch_first),
        train(False, mixed_precision, tied, switch_first),
    )


@pytest.mark.parametrize(
    ("mixed_precision", "tied", "switch_first"),
    [("no", False, True), ("bf16", False, False), ("no", True, False), ("bf16", True, True)],
)
def test_accelerate_fsdp2_path_gives_fsdp2_losses(run_ranks, mixed_precision, tied, switch_first):
    for ours, theirs in run_ranks(2, both, mixed_precision, tied, switch_first, timeout=600):
        assert ours["sharded_by"] and all(ours["sharded_by"].values()), ours["sharded_by"]
        assert not any(theirs["sharded_by"].values()), theirs["sharded_by"]
        # the plugin's policies: hyperfsdp's when built under the switch, torch's otherwise
        expected = "hyperfsdp_core.policies" if switch_first else "torch.distributed.fsdp"
        assert set(ours["policies"]) == {expected}, ours["policies"]
        assert len(ours["policies"]) == (2 if mixed_precision == "bf16" else 1)
        assert ours["losses"] == theirs["losses"]  # bit for bit
        assert ours["norms"] == theirs["norms"]
        assert ours["losses"][-1] < ours["losses"][0]
