"""Round trips at one world size: bitwise params and optimizer state, then parity."""

import pytest
import torch
import torch.distributed as dist
from dcp_testlib import (
    ResetRecorder,
    assert_all_reset,
    assert_bitwise,
    assert_close_loss,
    assert_params_close,
    build,
    full_state,
    make_mesh,
    optimizer,
    shard,
    train_step,
    trained,
)
from hyperfsdp_dcp import load_checkpoint, save_checkpoint
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def round_trip(path, kind):
    model, opt, ref, ref_opt = trained(kind, 2)
    save_checkpoint(path, model, opt, step=2)
    saved = full_state(model, opt)

    target = shard(build(kind, seed=1))  # different values everywhere
    target_opt = optimizer(target)
    assert saved.keys() != full_state(target, target_opt).keys() or not _equal(
        saved, full_state(target, target_opt)
    )
    with ResetRecorder() as resets:
        info = load_checkpoint(path, target, target_opt)
    assert info["step"] == 2 and info["world_size"] == dist.get_world_size()
    assert_bitwise(full_state(target, target_opt), saved, "after load")
    # the core rebuilt every managed parameter's padded storage after the load
    assert_all_reset(target, resets)

    # one more step: the loaded copy, the saving model and the single-process reference agree
    loss = train_step(kind, target, target_opt, 2)
    src_loss = train_step(kind, model, opt, 2)
    ref_loss = train_step(kind, ref, ref_opt, 2, sharded=False)
    assert loss == src_loss
    assert_bitwise(full_state(target, target_opt), full_state(model, opt), "one step later")
    tol = 2e-2 if kind == "mixed" else 1e-5  # bf16 parameters
    assert_close_loss(loss, ref_loss, tol)
    assert_params_close(target, ref, atol=tol, rtol=tol)
    return len(saved)


def _equal(a, b):
    try:
        assert_bitwise(a, b)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize(
    ("kind", "world"), [("mlp", 2), ("mlp", 4), ("tied", 2), ("mixed", 2), ("mixed", 4)]
)
def test_round_trip_is_bitwise_and_training_continues(run_ranks, tmp_path, kind, world):
    counts = run_ranks(world, round_trip, str(tmp_path / "ckpt"), kind)
    assert len(set(counts)) == 1 and counts[0] > 8


def full_state_dict_paths(kind, layout):
    """Full state dicts: gathered to rank 0 on CPU, then broadcast from rank 0 into a fresh model."""
    model, opt, ref, _ = trained(kind, 2, make_mesh(layout))
    tol = 2e-2 if kind == "mixed" else 1e-5
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, [opt], options=opts)
    if dist.get_rank() == 0:
        ref_sd = ref.state_dict()
        assert msd.keys() == ref_sd.keys()
        for k, v in msd.items():
            assert type(v) is torch.Tensor and v.device.type == "cpu", k
            torch.testing.assert_close(v, ref_sd[k], atol=tol, rtol=tol)
        assert osd["state"], "optimizer state is gathered too"
    else:
        assert (msd == {} and osd == {}) or not msd  # cpu_offload keeps it on rank 0 only
    saved = full_state(model, opt)

    # a fresh model on the meta device, filled only by the broadcast from rank 0
    with torch.device("meta"):
        target = build(kind, seed=1)
    shard(target, make_mesh(layout))
    target.to_empty(device="cpu")
    target_opt = optimizer(target)
    # Non-zero ranks pass empty dicts. Not set_state_dict(): with an empty model state dict
    # it treats the call as optimizer-only on those ranks, and rank 0 waits forever.
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    rank0 = dist.get_rank() == 0
    set_model_state_dict(target, msd if rank0 else {}, options=load)
    set_optimizer_state_dict(target, [target_opt], osd if rank0 else {}, options=load)
    assert_bitwise(full_state(target, target_opt), saved, "after broadcast load")
    assert train_step(kind, target, target_opt, 2) == train_step(kind, model, opt, 2)
    return True


@pytest.mark.parametrize(
    ("kind", "world", "layout"),
    [("mlp", 2, "fsdp"), ("tied", 2, "fsdp"), ("mixed", 2, "fsdp"), ("mlp", 4, "hsdp")],
)
def test_full_state_dict_cpu_offload_and_broadcast_from_rank0(run_ranks, kind, world, layout):
    assert run_ranks(world, full_state_dict_paths, kind, layout) == [True] * world
