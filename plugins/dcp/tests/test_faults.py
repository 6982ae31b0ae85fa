"""Checkpoints that survive damage, and failed saves that say where they failed.

Each fault leaves the live model and optimizer byte-identical, raises the right error class
with a message naming the checkpoint and the file (or the step and the rank), and
``resume()`` lands on the previous good checkpoint, from which training reproduces the
uninterrupted run's losses.

Killed and stopped ranks run in processes of their own (the persistent rank pool would be
torn down) with a 3 s process-group timeout, so that nothing waits for long.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_testlib import assert_bitwise, build, full_state, optimizer, shard, train_step
from hyperfsdp_dcp import (
    CheckpointLoadError,
    CheckpointManager,
    CheckpointMismatchError,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from torch.distributed.device_mesh import DeviceMesh

from hyperfsdp_core.cli import main
from hyperfsdp_core.testing.reference import MLPStack

KIND = "mlp"
STEPS = 6  # the uninterrupted run; checkpoints at steps 2 and 4
PG_TIMEOUT = 3.0


def new_manager(root, model, opt, **kwargs) -> CheckpointManager:
    return CheckpointManager(root, model=model, optimizer=opt, every=2, **kwargs)


def uninterrupted_losses() -> list[float]:
    model = shard(build(KIND))
    opt = optimizer(model)
    return [train_step(KIND, model, opt, step) for step in range(STEPS)]


def resumed_losses(root) -> tuple[int, list[float], list[str]]:
    """A fresh job (other initial values) resumes from ``root`` and trains to STEPS."""
    model = shard(build(KIND, seed=3))
    opt = optimizer(model)
    manager = new_manager(root, model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = manager.resume()
    manager.close()
    skipped = [str(w.message) for w in caught if "resume skips" in str(w.message)]
    return start, [train_step(KIND, model, opt, step) for step in range(start, STEPS)], skipped


# -- damaged files ------------------------------------------------------------------------------


def _flip_inside(path: Path, needle: bytes) -> None:
    """Flip the lowest bit of a float's mantissa inside tensor data: still a valid file."""
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0, f"tensor bytes not found in {path}"
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def damage(ckpt: Path, how: str, needle: bytes) -> str:
    """Damage a copy of a checkpoint; returns the file whose name the error must carry."""
    if how == "truncated":
        victim = ckpt / "__1_0.distcp"
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif how == "flipped":
        victim = ckpt / "__0_0.distcp"
        _flip_inside(victim, needle)
    elif how == "unchecked":  # no checksums to catch it: the read itself fails, on rank 1
        (ckpt / "checksums.json").unlink()
        victim = ckpt / "__1_0.distcp"
        data = bytearray(victim.read_bytes())
        data[:64] = b"\x00" * 64
        victim.write_bytes(bytes(data))
    elif how == "metadata":
        victim = ckpt / ".metadata"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2 :] = b"\x00" * (len(data) - len(data) // 2)
        victim.write_bytes(bytes(data))
    else:
        raise ValueError(how)
    return victim.name


EXPECTED = {
    "truncated": "truncated",
    "flipped": "content changed since the save",
    "metadata": "content changed since the save",
    "unchecked": "reading it failed",
}


def damaged_loads(root: str) -> dict:
    root = Path(root)
    rank = dist.get_rank()
    model = shard(build(KIND))
    opt = optimizer(model)
    manager = new_manager(root / "run", model, opt)
    for step in range(STEPS):
        train_step(KIND, model, opt, step)
        if step + 1 < STEPS:
            manager.maybe_save(step + 1)
        if step + 1 == 4:  # the bytes of rank 0's rows of one weight, as saved
            needle = model.layers[1].weight.to_local().detach().numpy().tobytes()
    manager.close()
    before = full_state(model, opt)  # the live model at step 6: differs from both checkpoints
    out: dict = {}
    for how in ("truncated", "flipped", "metadata", "unchecked", "shape"):
        copy = root / how
        if rank == 0:
            shutil.copytree(root / "run", copy)
            if how != "shape":
                out[how] = damage(copy / "step-4", how, needle)
        dist.barrier()
        if how == "shape":  # step-4 written by a model whose first layer is wider
            torch.manual_seed(0)
            wide = shard(MLPStack([5, 9, 3, 6, 2]))
            save_checkpoint(copy / "step-4", wide, optimizer(wide), step=4)
            expected, error_class = "global shape", CheckpointMismatchError
        else:
            expected, error_class = EXPECTED[how], CheckpointLoadError
        try:
            load_checkpoint(copy / "step-4", model, opt)
        except CheckpointLoadError as exc:
            assert type(exc) is error_class, (how, type(exc), str(exc))
            message = str(exc)
        else:
            raise AssertionError(f"{how}: the damaged checkpoint loaded")
        assert str(copy / "step-4") in message, message
        if how == "unchecked":  # rank 0 read its part: only the staging copy kept it out
            assert EXPECTED[how] in message, message
        elif how != "shape":
            name = [out.get(how)]
            dist.broadcast_object_list(name, src=0)
            assert f"{name[0]}: {expected}" in message, message
        else:
            assert "model.layers.0.weight: global shape (9, 5)" in message, message
        assert_bitwise(full_state(model, opt), before, f"{how}: after the failed load")
        dist.barrier()
    # the switch that skips checksums: a flipped bit then loads (sizes are still checked)
    load_checkpoint(root / "flipped" / "step-4", model, opt, verify=False)
    try:
        load_checkpoint(root / "truncated" / "step-4", model, opt, verify=False)
    except CheckpointLoadError as exc:
        assert "__1_0.distcp: truncated" in str(exc), str(exc)
    else:
        raise AssertionError("a truncated file loaded with verify=False")
    dist.barrier()

    expected_losses = uninterrupted_losses()
    for how in ("truncated", "flipped", "metadata", "unchecked", "shape"):
        start, losses, skipped = resumed_losses(root / how)
        assert start == 2, (how, start)
        assert losses == expected_losses[2:], (how, losses, expected_losses)
        assert len(skipped) == 1 and str(root / how / "step-4") in skipped[0], skipped
    start, losses, skipped = resumed_losses(root / "run")
    assert (start, losses, skipped) == (4, expected_losses[4:], [])
    out.pop("unchecked", None)  # nothing recorded to verify it against
    return out


def test_damaged_checkpoints(run_ranks, tmp_path, capsys):
    out = run_ranks(2, damaged_loads, str(tmp_path))[0]
    # offline: the intact checkpoint passes, each damaged one names its file
    intact = verify_checkpoint(tmp_path / "run" / "step-4")
    assert intact.ok and intact.has_checksums and intact.files == 2, str(intact)
    assert main(["ckpt", "verify", str(tmp_path / "run")]) == 0
    for how, name in out.items():
        result = verify_checkpoint(tmp_path / how / "step-4")
        assert [p.file for p in result.problems] == [name], str(result)
        assert EXPECTED[how] in str(result), str(result)
        assert main(["ckpt", "verify", str(tmp_path / how / "step-4")]) == 1
    capsys.readouterr()
    assert main(["ckpt", "verify", str(tmp_path / "truncated")]) == 1
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith(f"{tmp_path / 'truncated' / 'step-4'}: DAMAGED, 1 problem:"), text
    assert text[1].startswith("  __1_0.distcp: truncated:"), text
    assert text[2] == (
        f"{tmp_path / 'truncated' / 'step-2'}: OK, 2 data files, sizes and CRC-32 checksums match"
    ), text


def metadata_deleted(root: str) -> tuple[int, list[str], bool]:
    """Steps 2 and 4 saved, then step-4's ``.metadata`` deleted: resume() names step-4 as
    damaged in its warning and loads step 2, bit for bit."""
    root = Path(root)
    model = shard(build(KIND))
    opt = optimizer(model)
    manager = new_manager(root, model, opt)
    for step in range(4):
        train_step(KIND, model, opt, step)
        manager.maybe_save(step + 1)
        if step + 1 == 2:
            at_2 = full_state(model, opt)
    manager.close()
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "step-4" / ".metadata").unlink()
    dist.barrier()
    fresh = shard(build(KIND, seed=3))
    fresh_opt = optimizer(fresh)
    resumer = new_manager(root, fresh, fresh_opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = resumer.resume()
    resumer.close()
    skipped = [str(w.message) for w in caught if "resume skips" in str(w.message)]
    assert_bitwise(full_state(fresh, fresh_opt), at_2, "resumed from step 2")
    return start, skipped, resumer.steps() == [2]


def test_checkpoint_without_metadata_is_reported_damaged(run_ranks, tmp_path, capsys):
    root = tmp_path / "ckpt"
    for start, skipped, steps in run_ranks(2, metadata_deleted, str(root)):
        assert start == 2 and steps, (start, steps)
        assert len(skipped) == 1, skipped
        assert f"resume skips {root / 'step-4'}" in skipped[0], skipped
        missing = ".metadata: missing (deleted, or the directory was copied half-way"
        assert missing in skipped[0], skipped
    # offline: verify names it and fails, for the directory and for the manager root
    result = verify_checkpoint(root / "step-4")
    assert not result.ok and [p.file for p in result.problems] == [".metadata"], str(result)
    capsys.readouterr()
    assert main(["ckpt", "verify", str(root)]) == 1
    text = capsys.readouterr().out.splitlines()
    assert text[0] == f"{root / 'step-4'}: DAMAGED, 1 problem:", text
    assert text[1].startswith("  .metadata: missing (deleted"), text
    assert text[2].startswith(f"{root / 'step-2'}: OK, 2 data files"), text
    assert main(["ckpt", "verify", str(root), "--step", "4"]) == 1
    assert main(["ckpt", "verify", str(root / "step-4")]) == 1


def test_full_disk_is_named(tmp_path):
    """A save onto a full tmpfs (mounted in a private mount namespace) says ENOSPC and
    where, not only torch's ``unexpected pos``; the earlier checkpoint stays, and once there
    is room the next save works."""
    job = Path(__file__).with_name("full_disk_job.py")
    mount, out = tmp_path / "mnt", tmp_path / "out"
    out.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to mount a private tmpfs")
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    proc = subprocess.run(
        [*unshare, sys.executable, str(job), str(mount), str(tmp_path / "store"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == 3 or (proc.returncode != 0 and "unshare" in proc.stderr[:200]):
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    partial = mount / "ckpt" / ".step-4.partial"
    for rank in range(2):
        r = json.loads((out / f"rank-{rank}.json").read_text())
        message = r["message"]
        assert r["step"] == 4 and r["ranks"] and set(r["ranks"]) <= {0, 1}, r
        assert f"saving step 4 ({mount / 'ckpt' / 'step-4'}) failed on rank" in message, message
        named = (
            f"writing to {partial} fails with ENOSPC: No space left on device; its filesystem "
            f"has 0 of {8 << 20} bytes free (the error: "
        )
        assert named in message, message
        # each failing rank says so (ranks with the same text are named together)
        assert message.count(named) == len(set(message.split("(the error: ")[1:])), message
        assert "unexpected pos" in message, message  # torch.save lost the OSError there
        assert r["after_failure"] == [2] and r["after_freeing"] == [2, 4], r


# -- killed and stopped ranks -------------------------------------------------------------------


def _kill_self_in_write(sig: int):
    original = dcp.FileSystemWriter.write_data

    def write_data(writer, plan, planner):
        future = original(writer, plan, planner)
        future.wait()  # some files are on disk
        os.kill(os.getpid(), sig)
        time.sleep(60)  # a stopped thread never returns
        return future

    dcp.FileSystemWriter.write_data = write_data


def _kill_self_after_commit(manager, rank: int, final: Path) -> None:
    """Die right after the coordinator has committed ``final``: on the coordinator, in its
    housekeeping after the rename; elsewhere, once the rename shows on disk."""
    if rank == 0:
        manager._prune = lambda: os.kill(os.getpid(), signal.SIGKILL)
        return
    import hyperfsdp_dcp._io as io

    original = io._on_coordinator

    def on_coordinator(group, fn):
        if fn.__name__ == "rename":
            deadline = time.monotonic() + 60
            while not (final / ".metadata").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(group, fn)

    io._on_coordinator = on_coordinator


def fault_rank(rank, world, store_path, root, scenario, victim, out_dir, timeout) -> None:
    """One rank of a job whose ``victim`` rank is killed (or stopped) while saving step 4:
    ``kill`` and ``stop`` while it writes its files, ``committed`` once step 4 is committed."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    # A generous timeout for the rendezvous (processes start slowly on a loaded machine),
    # then the job's group, with a short one, once every rank is up.
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    dist.barrier()
    group = dist.new_group(timeout=timedelta(seconds=timeout))
    result: dict = {}
    start = time.monotonic()
    model = shard(build(KIND), DeviceMesh.from_group(group, "cpu"))
    opt = optimizer(model)
    manager = new_manager(root, model, opt, async_save=scenario == "stop", process_group=group)
    try:
        with manager:
            for step in range(2):
                train_step(KIND, model, opt, step)
            manager.save(2)
            manager.wait()
            for step in range(2, 4):
                train_step(KIND, model, opt, step)
            if rank == victim and scenario == "committed":
                _kill_self_after_commit(manager, rank, Path(root) / "step-4")
            elif rank == victim:
                _kill_self_in_write(signal.SIGKILL if scenario == "kill" else signal.SIGSTOP)
            start = time.monotonic()
            try:
                manager.save(4)
                if scenario == "stop":  # the loop goes on; its next collective times out
                    if rank == victim:
                        time.sleep(60)  # stopped by its writer thread meanwhile
                    train_step(KIND, model, opt, 4)
            finally:
                result["raised_after"] = time.monotonic() - start
    except Exception as exc:
        result.update(error=type(exc).__name__, message=str(exc))
        result["step"] = getattr(exc, "step", None)
        result["ranks"] = getattr(exc, "ranks", None)
        result["committed"] = getattr(exc, "committed", None)
    result["exited_after"] = time.monotonic() - start
    (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown with a dead peer


def run_job(
    world: int, scenario: str, victim: int, tmp_path: Path, timeout: float = PG_TIMEOUT
) -> dict[int, dict]:
    ctx = multiprocessing.get_context("spawn")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = (str(tmp_path / "store"), str(tmp_path / "ckpt"), scenario, victim, str(out_dir))
    procs = [ctx.Process(target=fault_rank, args=(r, world, *args, timeout)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 90 + 3 * timeout
    try:
        for r, p in enumerate(procs):
            if r != victim:
                p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # the stopped victim; a survivor still here is a hang
            p.join(10)
    results = {}
    for r in range(world):
        if r != victim:
            path = out_dir / f"rank-{r}.json"
            assert path.exists(), (
                f"rank {r} did not finish ({scenario}): exit code {procs[r].exitcode}"
            )
            results[r] = json.loads(path.read_text())
    return results


def resume_after_fault(root: str) -> tuple[int, bool]:
    """A fresh job resumes from ``root`` and trains to STEPS with the uninterrupted losses."""
    start, losses, skipped = resumed_losses(root)
    expected = uninterrupted_losses()[start:]
    assert losses == expected and not skipped, (losses, expected, skipped)
    return start, True


@pytest.mark.parametrize(("world", "victim"), [(4, 0)])  # the coordinator; three survivors
def test_rank_killed_during_save(run_ranks, tmp_path, world, victim):
    results = run_job(world, "kill", victim, tmp_path)
    for rank, r in results.items():
        assert r.get("error") == "CheckpointSaveError", (rank, r)
        assert r["step"] == 4 and r["ranks"] == [victim], (rank, r)
        assert (
            f"saving step 4 ({tmp_path / 'ckpt' / 'step-4'}) failed on rank {victim}"
            in (r["message"])
        ), r["message"]
        # its process exited on this host: known at once, not after the 7 s wait
        assert f"rank {victim}: its process (pid " in r["message"], r["message"]
        assert "Nothing was committed" in r["message"] and not r["committed"], r
        assert r["exited_after"] < 4 * PG_TIMEOUT + 5, r
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-2"]
    assert run_ranks(world, resume_after_fault, str(tmp_path / "ckpt")) == [(2, True)] * world


def test_rank_stopped_during_async_save(run_ranks, tmp_path):
    results = run_job(2, "stop", 1, tmp_path)
    r = results[0]
    # the training step's collective times out; leaving the manager waits for the async
    # write for at most the process group's timeout, not its own half hour
    assert r.get("error") not in (None, "CheckpointSaveError"), r  # the transport's timeout
    assert r["exited_after"] < 3 * PG_TIMEOUT + 5, r
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-2"]
    assert run_ranks(2, resume_after_fault, str(tmp_path / "ckpt")) == [(2, True)] * 2


SAVE_TIMEOUT = 10.0  # the group's timeout in the tests below: the old wait was 21 s


@pytest.mark.parametrize("victim", [1, 0])
def test_rank_killed_during_save_is_reported_within_the_timeout(run_ranks, tmp_path, victim):
    """gloo reports the closed connection at once; the survivor knows the victim's process
    has exited (same host) and raises without waiting out twice the timeout."""
    (r,) = run_job(2, "kill", victim, tmp_path, SAVE_TIMEOUT).values()
    assert r.get("error") == "CheckpointSaveError" and r["ranks"] == [victim], r
    assert f"failed on rank {victim} (rank {victim}: its process (pid " in r["message"], r
    assert r["raised_after"] < SAVE_TIMEOUT, r
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-2"]


@pytest.mark.parametrize("victim", [1, 0])
def test_rank_killed_after_the_commit_says_it_was_committed(run_ranks, tmp_path, victim):
    """A rank dies once the coordinator has renamed step 4 into place (rank 0 itself in its
    housekeeping right after the rename, or rank 1): the survivor says the step was
    committed, and a fresh job resumes from it."""
    (r,) = run_job(2, "committed", victim, tmp_path, SAVE_TIMEOUT).values()
    assert r.get("error") == "CheckpointSaveError", r
    assert r["step"] == 4 and r["ranks"] == [victim] and r["committed"] is True, r
    final = tmp_path / "ckpt" / "step-4"
    said = f"saving step 4 ({final}): the checkpoint was committed ({final} is complete"
    assert said in r["message"], r["message"]
    assert "Nothing was committed" not in r["message"], r["message"]
    assert r["raised_after"] < SAVE_TIMEOUT, r
    assert verify_checkpoint(final).ok
    assert run_ranks(2, resume_after_fault, str(tmp_path / "ckpt")) == [(4, True)] * 2
