"""The multi-rank test harness: run_on_ranks / the run_ranks fixture."""

from __future__ import annotations

import os
import signal
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from hyperfsdp_core.testing import RankFailure, RankTimeout, current_rank, run_on_ranks

TIMEOUT = 120  # generous: the machine may be busy; a hang still fails the test


# -- rank functions (module level: the rank processes import them by name) -------------------------


def all_reduce_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), current_rank(), dist.get_backend()


def echo(a, b=0, *, c=None):
    return dist.get_rank(), a, b, c


def pid():
    return os.getpid()


def raise_on_rank_1():
    if dist.get_rank() == 1:
        _helper_that_raises()
    return "fine"


def _helper_that_raises():
    raise ValueError("distinctive-marker-7c1f: rank one exploded")


def raise_on_rank_1_while_others_wait():
    if dist.get_rank() == 1:
        raise KeyError("other-ranks-are-stuck-marker")
    dist.barrier()  # never completes: rank 1 does not join
    return "unreachable"


def hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(600)
    return dist.get_rank()


def die_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


def segfault_on_rank_1():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # what a crash in native code delivers
    return dist.get_rank()


def unpicklable_result():
    return lambda: None


def dirty_the_process():
    os.environ["HYPERFSDP_HARNESS_LEFTOVER"] = "1"
    torch.manual_seed(1234)
    torch.rand(100)
    torch.set_default_dtype(torch.float64)
    from hyperfsdp_core import hookimpl
    from hyperfsdp_core.plugin.manager import get_plugin_manager

    class Leftover:
        @hookimpl
        def hyperfsdp_validate_unit(self, unit):
            return None

    get_plugin_manager().register(Leftover(), name="leftover")  # never unregistered
    return torch.get_default_dtype() == torch.float64


def dirty_the_process_and_raise():
    os.environ["HYPERFSDP_HARNESS_LEFTOVER"] = "2"
    raise RuntimeError("left a mess")


def observe_state():
    from hyperfsdp_core.plugin.manager import get_plugin_manager

    return (
        os.environ.get("HYPERFSDP_HARNESS_LEFTOVER"),
        torch.rand(3).tolist(),
        torch.get_default_dtype() == torch.float32,
        get_plugin_manager().get_plugin("leftover") is None,
        os.environ.get("HYPERFSDP_TEST_RANK"),
    )


def make_groups(n: int) -> int:
    """Make ``n`` process groups over every rank and leave them alive; this process's
    thread count."""
    from hyperfsdp_core.testing.pool import _native_thread_count

    for _ in range(n):
        group = dist.new_group(list(range(dist.get_world_size())))
        dist.barrier(group=group)
    return _native_thread_count()


def new_world(store_dir: str) -> int:
    """Replace the c10d world (as a test of re-initialization does); this process's id."""
    from datetime import timedelta

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    return os.getpid()


def environment(name: str) -> str | None:
    return os.environ.get(name)


def trivial():
    return None


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_on_every_world_size(world_size):
    results = run_on_ranks(world_size, all_reduce_sum, timeout=TIMEOUT)
    total = world_size * (world_size + 1) / 2
    assert results == [(r, world_size, total, r, "gloo") for r in range(world_size)]


def test_arguments_and_results_travel_per_rank(run_ranks):
    assert run_ranks is run_on_ranks
    results = run_ranks(2, echo, [1, 2], b={"x": 3}, c=torch.ones(2), timeout=TIMEOUT)
    assert [r[:3] for r in results] == [(0, [1, 2], {"x": 3}), (1, [1, 2], {"x": 3})]
    assert all(torch.equal(r[3], torch.ones(2)) for r in results)


def test_exception_on_one_rank_reports_its_traceback():
    pids = run_on_ranks(2, pid, timeout=TIMEOUT)
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, raise_on_rank_1, timeout=TIMEOUT)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed: ValueError: distinctive-marker-7c1f")
    assert "Traceback (most recent call last)" in message
    assert "in _helper_that_raises" in message  # the rank's own traceback, not the driver's
    assert 'raise ValueError("distinctive-marker-7c1f: rank one exploded")' in message
    assert isinstance(info.value, AssertionError)
    # Every rank answered, so the pool is kept: same processes next time.
    assert run_on_ranks(2, pid, timeout=TIMEOUT) == pids


def test_exception_while_other_ranks_block_fails_fast_and_rebuilds():
    pids = run_on_ranks(2, pid, timeout=TIMEOUT)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, raise_on_rank_1_while_others_wait, timeout=TIMEOUT)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1 of 2 failed: KeyError: 'other-ranks-are-stuck-marker'" in message
    assert "ranks [0] did not finish" in message
    assert elapsed < 30, f"took {elapsed:.1f}s: should not wait for the {TIMEOUT}s timeout"
    new_pids = run_on_ranks(2, pid, timeout=TIMEOUT)
    assert set(new_pids).isdisjoint(pids)
    assert run_on_ranks(2, all_reduce_sum, timeout=TIMEOUT)[1][2] == 3.0


def test_hung_rank_times_out_and_the_pool_is_rebuilt():
    pids = run_on_ranks(2, pid, timeout=TIMEOUT)
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_on_ranks(2, hang_on_rank_1, timeout=5)
    elapsed = time.monotonic() - start
    assert 5 <= elapsed < 25, f"RankTimeout after {elapsed:.1f}s with timeout=5"
    assert "ranks [1] of 2 did not finish within 5s" in str(info.value)
    # The next call on the same world size runs on fresh processes and passes.
    new_pids = run_on_ranks(2, pid, timeout=TIMEOUT)
    assert set(new_pids).isdisjoint(pids)
    assert run_on_ranks(2, all_reduce_sum, timeout=TIMEOUT) == [
        (0, 2, 3.0, 0, "gloo"),
        (1, 2, 3.0, 1, "gloo"),
    ]


def test_dead_rank_is_reported_and_the_pool_is_rebuilt():
    pids = run_on_ranks(2, pid, timeout=TIMEOUT)
    with pytest.raises(RankFailure, match=r"rank 1 process died \(exit code 3\)"):
        run_on_ranks(2, die_on_rank_1, timeout=TIMEOUT)
    new_pids = run_on_ranks(2, pid, timeout=TIMEOUT)
    assert set(new_pids).isdisjoint(pids)
    for old in pids:  # the surviving rank 0 was stopped too, not left behind
        deadline = time.monotonic() + 30
        while _alive(old) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(old), f"rank process {old} of the broken pool is still running"


def test_a_rank_killed_by_a_signal_reports_its_stacks():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, segfault_on_rank_1, timeout=TIMEOUT)
    message = str(info.value)
    assert "rank 1 process died (exit code -11)" in message
    assert "Segmentation fault" in message  # faulthandler's report, read from its file
    assert "in segfault_on_rank_1" in message  # the Python frame it died in
    assert run_on_ranks(2, trivial, timeout=TIMEOUT) == [None, None]  # the pool was rebuilt


def _alive(process_id: int) -> bool:
    try:
        os.kill(process_id, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        with open(f"/proc/{process_id}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_unpicklable_result_is_a_failure():
    with pytest.raises(RankFailure, match="result not picklable"):
        run_on_ranks(1, unpicklable_result, timeout=TIMEOUT)
    assert run_on_ranks(1, echo, 5, timeout=TIMEOUT) == [(0, 5, 0, None)]


def test_non_module_level_function_is_refused():
    def local():
        return 1

    with pytest.raises(TypeError, match="needs a module-level function"):
        run_on_ranks(1, local, timeout=TIMEOUT)
    with pytest.raises(TypeError, match="needs a module-level function"):
        run_on_ranks(1, lambda: 1, timeout=TIMEOUT)


def test_process_state_is_reset_between_calls():
    expected_rand = torch.Generator().manual_seed(0)
    expected = torch.rand(3, generator=expected_rand).tolist()
    assert run_on_ranks(2, dirty_the_process, timeout=TIMEOUT) == [True, True]
    assert run_on_ranks(2, observe_state, timeout=TIMEOUT) == [
        (None, expected, True, True, "0"),
        (None, expected, True, True, "1"),
    ]
    with pytest.raises(RankFailure, match="left a mess"):
        run_on_ranks(2, dirty_the_process_and_raise, timeout=TIMEOUT)
    assert [r[0] for r in run_on_ranks(2, observe_state, timeout=TIMEOUT)] == [None, None]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_pool_left_with_too_many_groups_is_replaced():
    """Process groups a call leaves behind keep gloo threads polling in the ranks: past
    ``MAX_THREADS`` the pool is replaced, and the next call runs in fresh processes."""
    from hyperfsdp_core.testing import pool

    pids = run_on_ranks(2, pid, timeout=TIMEOUT)
    threads = run_on_ranks(2, make_groups, 2, timeout=TIMEOUT)
    assert max(threads) <= pool.MAX_THREADS  # a few groups: kept
    assert run_on_ranks(2, pid, timeout=TIMEOUT) == pids
    threads = run_on_ranks(2, make_groups, pool.MAX_THREADS // 3, timeout=TIMEOUT)
    assert min(threads) > pool.MAX_THREADS  # gloo: 3 threads per group
    new_pids = run_on_ranks(2, pid, timeout=TIMEOUT)
    assert set(new_pids).isdisjoint(pids)
    assert not any(_alive(old) for old in pids)  # stopped, not left behind
    assert max(run_on_ranks(2, make_groups, 0, timeout=TIMEOUT)) < 16
    assert run_on_ranks(2, all_reduce_sum, timeout=TIMEOUT)[0][2] == 3.0


def test_a_pool_whose_world_was_replaced_is_replaced(tmp_path):
    """A call that re-initializes the c10d world leaves torch's caches of the old one behind:
    the next call runs in fresh processes."""
    pids = run_on_ranks(2, new_world, str(tmp_path), timeout=TIMEOUT)
    new_pids = run_on_ranks(2, pid, timeout=TIMEOUT)
    assert set(new_pids).isdisjoint(pids)
    assert run_on_ranks(2, all_reduce_sum, timeout=TIMEOUT)[0][2] == 3.0


def test_ranks_take_the_test_process_environment(monkeypatch):
    """Forked from a server started earlier, a new pool's ranks still see the environment
    of the test process as it is when the pool starts (as spawned processes would)."""
    from hyperfsdp_core.testing import close_pools

    close_pools()
    monkeypatch.setenv("HYPERFSDP_HARNESS_PROBE", "set by the test")
    try:
        probe = run_on_ranks(2, environment, "HYPERFSDP_HARNESS_PROBE", timeout=TIMEOUT)
    finally:
        close_pools()  # the next tests' ranks start without it
    assert probe == ["set by the test"] * 2


def test_invalid_world_size_is_rejected():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_on_ranks(0, trivial)


def test_warm_call_overhead_of_four_ranks(capsys):
    run_on_ranks(4, trivial, timeout=TIMEOUT)  # start (or reuse) the pool
    times = []
    for _ in range(21):
        start = time.perf_counter()
        assert run_on_ranks(4, trivial, timeout=TIMEOUT) == [None] * 4
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    with capsys.disabled():
        print(f"\nrun_on_ranks(4, trivial) warm overhead: median {median * 1000:.2f} ms")
    assert median < 2.0, f"a trivial 4-rank call takes {median:.3f}s (median of 21)"
