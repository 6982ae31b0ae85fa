"""CheckpointManager: resuming after a simulated crash reproduces an uninterrupted run.

The training loop draws noise from the global RNG, follows an LR schedule and reads its
batches through a stateful data cursor: a resume that failed to restore any of them, or the
model, optimizer or step, would change the losses that follow.
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dcp_testlib import assert_bitwise, build, full_state, local, loss_of, optimizer, shard
from hyperfsdp_dcp import CheckpointManager

TOTAL = 7
EVERY = 2
KEEP = 2


class DataCursor:
    """A stateful stand-in for a data loader: which batch comes next."""

    def __init__(self) -> None:
        self.position = 0

    def next_batch(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(5000 + self.position)
        self.position += 1
        return torch.randn(8, 5, generator=g)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class SimulatedCrash(Exception):
    pass


def run(root, crash_after, async_save, seed=0):
    """Train to TOTAL steps (resuming from ``root``); ``crash_after``: raise after that step.

    ``seed`` initializes the model: a resumed run starts from other values, which the
    checkpoint must replace."""
    torch.manual_seed(1234 + dist.get_rank())  # per-rank RNG streams, as in real jobs
    model = shard(build("mlp", seed=seed))
    opt = optimizer(model)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 5], gamma=0.5)
    data = DataCursor()
    losses = {}
    manager = CheckpointManager(
        root,
        model=model,
        optimizer=opt,
        stateful={"scheduler": sched, "data": data},
        every=EVERY,
        keep_last=KEEP,
        async_save=async_save,
        timeout=timedelta(seconds=120),
    )
    try:
        with manager:
            step = start = manager.resume()
            while step < TOTAL:
                x = local(data.next_batch())
                x = x + 0.1 * torch.randn_like(x)  # per-rank noise from the RNG
                loss = loss_of("mlp", model(x), x)
                loss.backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                step += 1
                value = loss.detach().clone()
                dist.all_reduce(value)
                losses[step] = value.item()
                manager.maybe_save(step)
                if step == crash_after:
                    raise SimulatedCrash
    except SimulatedCrash:
        return {"start": start, "losses": losses, "crashed": True, "steps": manager.steps()}
    return {
        "start": start,
        "losses": losses,
        "crashed": False,
        "steps": manager.steps(),
        "final": full_state(model, opt),
        "lr": opt.param_groups[0]["lr"],
    }


@pytest.mark.parametrize(("world", "async_save"), [(2, False), (2, True)])
def test_resume_after_crash_reproduces_uninterrupted_run(run_ranks, tmp_path, world, async_save):
    clean = run_ranks(world, run, str(tmp_path / "clean"), None, async_save)[0]
    assert clean["start"] == 0 and sorted(clean["losses"]) == list(range(1, TOTAL + 1))
    assert clean["steps"] == [4, 6]  # saved at 2, 4, 6; the last KEEP kept

    first = run_ranks(world, run, str(tmp_path / "crash"), 5, async_save)[0]
    assert first["crashed"] and sorted(first["losses"]) == [1, 2, 3, 4, 5]
    # sync: step-4 was committed; async: step-4 was still in flight (it would have been
    # committed by the next save), so it stays partial and the resume starts from step 2
    expected_start = 2 if async_save else 4
    assert first["steps"][-1] == expected_start

    resumed = run_ranks(world, run, str(tmp_path / "crash"), None, async_save, 7)[0]
    assert resumed["start"] == expected_start
    assert sorted(resumed["losses"]) == list(range(expected_start + 1, TOTAL + 1))
    for step, loss in resumed["losses"].items():
        assert loss == clean["losses"][step], (step, loss, clean["losses"][step])
    assert resumed["lr"] == clean["lr"]
    assert_bitwise(resumed["final"], clean["final"], "final state")
    assert resumed["steps"] == [4, 6]  # and the partial leftover was cleaned up
    assert sorted(p.name for p in (tmp_path / "crash").iterdir()) == ["step-4", "step-6"]
