"""Checkpoints move between torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) and hyperfsdp.

The FSDP2 side uses only torch: ``get_state_dict`` / ``set_state_dict`` and ``dcp.save`` /
``dcp.load`` of ``{"model": ..., "optim": ...}``, as an FSDP2 user writes it.
"""

import pytest
import torch.distributed.checkpoint as dcp
from dcp_testlib import (
    assert_bitwise,
    assert_close_loss,
    assert_params_close,
    build,
    full_state,
    optimizer,
    shard,
    train_step,
    trained,
)
from hyperfsdp_dcp import load_checkpoint, save_checkpoint
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from hyperfsdp_core import FSDPModule, fully_shard

KIND = "tied"  # a transformer with tied embedding/head and a frozen norm
STEPS = 2


def torch_save(path, model, opt):
    msd, osd = get_state_dict(model, [opt])
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def torch_load(path, model, opt):
    msd, osd = get_state_dict(model, [opt])
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, [opt], model_state_dict=state["model"], optim_state_dict=state["optim"])


def migrate(path, direction):
    src_engine, dst_engine = (
        (torch_fully_shard, None) if direction == "fsdp2->hyperfsdp" else (None, torch_fully_shard)
    )
    src, src_opt, ref, ref_opt = trained(KIND, STEPS, engine=src_engine or fully_shard)
    if src_engine is torch_fully_shard:
        torch_save(path, src, src_opt)
    else:
        save_checkpoint(path, src, src_opt, step=STEPS)
    saved = full_state(src, src_opt)

    dst = shard(build(KIND, seed=1), engine=dst_engine or fully_shard)
    dst_opt = optimizer(dst)
    if dst_engine is torch_fully_shard:
        torch_load(path, dst, dst_opt)
    else:
        assert load_checkpoint(path, dst, dst_opt) == {}  # FSDP2 wrote no trainer section
    assert_bitwise(full_state(dst, dst_opt), saved, f"{direction}: after load")

    # both engines take the next steps from the same state: they stay bitwise together, and
    # agree with the single-process reference
    for step in range(STEPS, STEPS + 2):
        loss = train_step(KIND, dst, dst_opt, step)
        src_loss = train_step(KIND, src, src_opt, step)
        ref_loss = train_step(KIND, ref, ref_opt, step, sharded=False)
        assert loss == src_loss  # the two engines compute the same bits on gloo
        assert_close_loss(loss, ref_loss)
    assert_bitwise(full_state(dst, dst_opt), full_state(src, src_opt), f"{direction}: 2 steps on")
    assert_params_close(dst, ref)
    return "hyperfsdp" if isinstance(dst, FSDPModule) else type(dst).__mro__[1].__module__


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("direction", ["fsdp2->hyperfsdp", "hyperfsdp->fsdp2"])
def test_checkpoints_move_between_fsdp2_and_hyperfsdp(run_ranks, tmp_path, world, direction):
    modules = run_ranks(world, migrate, str(tmp_path / "ckpt"), direction)
    # the loading side really was the other engine
    expected = "hyperfsdp" if direction.endswith("hyperfsdp") else "torch.distributed.fsdp"
    assert all(m.startswith(expected) for m in modules), modules
