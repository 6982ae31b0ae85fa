"""Loading checks keys, global shapes and dtypes first, names every mismatch, changes nothing."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dcp_testlib import assert_bitwise, full_state, optimizer, shard, train_step, trained
from hyperfsdp_dcp import (
    CheckpointLoadError,
    CheckpointMismatchError,
    load_checkpoint,
    save_checkpoint,
    validate_checkpoint,
)
from torch import nn

from hyperfsdp_core.testing.reference import MLPStack

# The checkpoint holds MLPStack([5, 7, 3, 6, 2]); the target differs in every way:
EXPECTED = {
    "layers.0.bias": "dtype",  # bf16 in the target
    "layers.1.weight": "shape",  # (4, 7) instead of (3, 7)
    "layers.1.bias": "shape",
    "layers.2.weight": "shape",  # (6, 4) instead of (6, 3)
    "layers.3.weight": "unexpected",  # the target has no layers.3
    "layers.3.bias": "unexpected",
    "extra.weight": "missing",  # the checkpoint has no extra
    "extra.bias": "missing",
}


def expected_mismatches() -> dict[str, str]:
    out = {}
    for fqn, problem in EXPECTED.items():
        out[f"model.{fqn}"] = problem
        for state in ("exp_avg", "exp_avg_sq"):
            out[f"optim.state.{fqn}.{state}"] = problem
        if problem in ("missing", "unexpected"):  # the scalar step exists or not with it
            out[f"optim.state.{fqn}.step"] = problem
    return out


def build_target() -> nn.Module:
    torch.manual_seed(5)
    model = MLPStack([5, 7, 4, 6])
    model.layers[0].bias.data = model.layers[0].bias.data.to(torch.bfloat16)
    model.extra = nn.Linear(2, 2)
    return model


def mismatched_load(path):
    model, opt, _, _ = trained("mlp", 1)
    save_checkpoint(path, model, opt, step=1)

    target = shard(build_target())
    target_opt = optimizer(target)
    for p in target.parameters():  # give the optimizer state (a bf16 bias cannot run forward)
        p.grad = torch.full_like(p, 0.01)
    target_opt.step()
    target_opt.zero_grad()
    before = full_state(target, target_opt)

    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(path, target, target_opt)
    found = {m.fqn: m.problem for m in info.value.mismatches}
    assert found == expected_mismatches(), sorted(
        set(found.items()) ^ set(expected_mismatches().items())
    )
    message = str(info.value)
    for fqn in expected_mismatches():
        assert f"  {fqn}: " in message, fqn
    assert "(4, 7)" in message and "(3, 7)" in message and "bfloat16" in message
    assert "nothing was loaded" in message and "hyperfsdp ckpt inspect" in message
    assert_bitwise(full_state(target, target_opt), before, "after the refused load")

    # an optimizer that had no state keeps none, and the model keeps its values
    fresh = optimizer(target)
    params = full_state(target)
    with pytest.raises(CheckpointMismatchError):
        load_checkpoint(path, target, fresh)
    assert not fresh.state
    assert_bitwise(full_state(target), params, "model after the refused load")
    assert validate_checkpoint(path, target, fresh) == info.value.mismatches
    assert not fresh.state

    # the matching model loads, and a missing section is named as such
    good = shard(MLPStack([5, 7, 3, 6, 2]))
    assert validate_checkpoint(path, good, optimizer(good)) == []
    with pytest.raises(CheckpointMismatchError, match=r"sched: no such section"):
        load_checkpoint(path, good, stateful={"sched": torch.optim.lr_scheduler.StepLR(opt, 1)})

    # no checkpoint, or one whose save never finished: a clear error on every rank
    with pytest.raises(CheckpointLoadError, match="no checkpoint directory"):
        load_checkpoint(Path(path).with_name("nowhere"), good)
    partial = Path(path).with_name("unfinished")
    if dist.get_rank() == 0:
        partial.mkdir()
    dist.barrier()
    with pytest.raises(CheckpointLoadError, match=r"1 damaged file:\n  \.metadata: missing"):
        load_checkpoint(partial, good)
    train_step("mlp", good, optimizer(good), 0)  # the process group is still in step
    return len(found)


def test_mismatched_load_names_every_fqn_and_changes_nothing(run_ranks, tmp_path):
    assert run_ranks(2, mismatched_load, str(tmp_path / "ckpt")) == [len(expected_mismatches())] * 2
