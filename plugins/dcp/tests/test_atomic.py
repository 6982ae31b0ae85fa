"""A save that fails on one rank leaves the previous checkpoint loadable; resume ignores partials."""

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_testlib import assert_bitwise, build, full_state, optimizer, shard, train_step, trained
from hyperfsdp_dcp import CheckpointManager, CheckpointSaveError


class _FailingWrites:
    """On ``rank``, DCP's file writer writes this rank's files, then fails (a full disk,
    a lost mount): the failure happens mid-save, with files already on disk."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.original = dcp.FileSystemWriter.write_data

    def __enter__(self):
        original, rank = self.original, self.rank

        def write_data(writer, plan, planner):
            future = original(writer, plan, planner)
            if dist.get_rank() == rank:
                future.wait()
                raise OSError(28, "No space left on device (injected)")
            return future

        dcp.FileSystemWriter.write_data = write_data
        return self

    def __exit__(self, *exc):
        dcp.FileSystemWriter.write_data = self.original


class _FailingState:
    """A stateful object whose state_dict() raises on one rank (before anything is written)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.fail = False

    def state_dict(self):
        if self.fail and dist.get_rank() == self.rank:
            raise RuntimeError("cannot snapshot the data loader (injected)")
        return {"ok": True}

    def load_state_dict(self, state):
        assert state == {"ok": True}


def failed_saves(root, async_save):
    root = Path(root)
    bad_rank = dist.get_world_size() - 1
    model, opt, _, _ = trained("mlp", 2)
    flaky = _FailingState(bad_rank)
    manager = CheckpointManager(
        root,
        model=model,
        optimizer=opt,
        stateful={"loader": flaky},
        async_save=async_save,
        timeout=timedelta(seconds=120),
    )
    manager.save(2)
    manager.wait()
    good = full_state(model, opt)
    files_at_2 = sorted(os.listdir(root / "step-2"))
    train_step("mlp", model, opt, 2)

    # 1) the write fails on the last rank, after its files are written
    with _FailingWrites(bad_rank):
        try:
            manager.save(4)
            manager.wait()  # an async save reports at the commit
        except CheckpointSaveError as exc:
            message = str(exc)
        else:
            raise AssertionError("the failed save did not raise")
    assert f"rank {bad_rank}" in message and "No space left" in message, message
    assert sorted(os.listdir(root)) == ["step-2"], os.listdir(root)
    assert sorted(os.listdir(root / "step-2")) == files_at_2

    # 2) a stateful object fails on one rank: every rank raises, nothing is written
    flaky.fail = True
    try:
        manager.save(6)
        manager.wait()
    except CheckpointSaveError as exc:
        assert f"rank {bad_rank}" in str(exc) and "injected" in str(exc), str(exc)
    else:
        raise AssertionError("the failed snapshot did not raise")
    flaky.fail = False
    assert sorted(os.listdir(root)) == ["step-2"], os.listdir(root)

    # 3) what a killed job leaves behind: a partial directory, a step directory without
    # DCP's .metadata (as if copied half-way)
    dist.barrier()  # every rank has looked at the directory above
    if dist.get_rank() == 0:
        (root / ".step-8.partial").mkdir()
        (root / ".step-8.partial" / "__0_0.distcp").write_bytes(b"garbage")
        (root / "step-9").mkdir()
        (root / "step-9" / "__0_0.distcp").write_bytes(b"garbage")
    dist.barrier()

    # a fresh job resumes from the last complete checkpoint, bit for bit
    model2 = shard(build("mlp", seed=3))
    opt2 = optimizer(model2)
    resumer = CheckpointManager(root, model=model2, optimizer=opt2, stateful={"loader": flaky})
    assert resumer.steps() == [2]
    assert resumer.resume() == 2
    assert_bitwise(full_state(model2, opt2), good, "resumed")

    # and the next save works, and clears what the killed job left
    resumer.save(10)
    assert sorted(os.listdir(root)) == ["step-10", "step-2", "step-9"]  # step-9: not ours
    manager.close()
    resumer.close()
    return True


@pytest.mark.parametrize(("world", "async_save"), [(2, False), (4, False), (2, True), (4, True)])
def test_failed_save_leaves_previous_checkpoint(run_ranks, tmp_path, world, async_save):
    assert run_ranks(world, failed_saves, str(tmp_path / "ckpt"), async_save) == [True] * world


def file_size_limit_on_one_rank(root):
    """The last rank's data file stops at its file-size limit (``ulimit -f``, with SIGXFSZ
    ignored, so the write fails with EFBIG): the error names that rank only, and why."""
    import resource
    import signal

    root = Path(root)
    rank, bad_rank = dist.get_rank(), dist.get_world_size() - 1
    model, opt, _, _ = trained("mlp", 2)
    manager = CheckpointManager(root, model=model, optimizer=opt, timeout=timedelta(seconds=120))
    manager.save(2)
    good = full_state(model, opt)
    size = (root / "step-2" / f"__{bad_rank}_0.distcp").stat().st_size
    saved_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    saved_handler = signal.getsignal(signal.SIGXFSZ)
    if rank == bad_rank:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, saved_limit[1]))
    try:
        manager.save(4)
    except CheckpointSaveError as exc:
        error = exc
    else:
        raise AssertionError("the save past the file-size limit did not raise")
    finally:
        if rank == bad_rank:
            resource.setrlimit(resource.RLIMIT_FSIZE, saved_limit)
            signal.signal(signal.SIGXFSZ, saved_handler)
    assert_bitwise(full_state(model, opt), good, "after the failed save")
    dist.barrier()
    listed = sorted(os.listdir(root))
    manager.close()
    return error.ranks, error.step, str(error), listed, size // 2


@pytest.mark.parametrize("world", [2, 4])
def test_one_rank_that_cannot_write_is_the_one_named(run_ranks, tmp_path, world):
    bad = world - 1
    for ranks, step, message, listed, limit in run_ranks(
        world, file_size_limit_on_one_rank, str(tmp_path / "ckpt")
    ):
        assert (ranks, step) == ([bad], 4), message
        assert f"failed on rank {bad} (rank {bad}: " in message, message
        partial = tmp_path / "ckpt" / ".step-4.partial"
        assert (
            f"{partial / f'__{bad}_0.distcp'} stopped at this process's file-size limit of "
            f"{limit} bytes (RLIMIT_FSIZE, `ulimit -f`; EFBIG: File too large)"
        ) in message, message
        assert "ranks 0" not in message and "DCP reported" not in message, message
        assert listed == ["step-2"], listed
