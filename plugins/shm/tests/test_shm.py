"""The shared-memory collectives (``_shm.py``): bit for bit equal to gloo's own, and clear
failures instead of wrong data or hangs."""

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
from hyperfsdp_shm import _shm
from hyperfsdp_shm.testing import created_segments

pytestmark = pytest.mark.skipif(not _shm.supported(), reason="needs Linux, x86-64 and /dev/shm")


def _world_transport(timeout: float = 60.0):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    transport = _shm.ShmGroup.create(None, rank, world, timedelta(seconds=timeout))
    assert transport is not None
    return transport, rank, world


def _bits(t):
    return t.view(torch.uint8)


def _with_specials(t):
    specials = torch.tensor([-0.0, float("inf"), float("-inf"), 1e-40]).to(t.dtype)
    t[: len(specials)] = specials
    t.view(torch.uint8)[-2:] = torch.tensor([0xC1, 0x7F], dtype=torch.uint8)  # a NaN payload
    return t


def shm_matches_gloo():
    import torch.distributed as dist

    transport, rank, world = _world_transport()
    out = {}
    chunk = _shm.CHUNK_BYTES
    # one element, under a chunk, exactly two chunks, and three chunks and a bit
    for dtype in (torch.float32, torch.bfloat16):
        size = torch.tensor([], dtype=dtype).element_size()
        for shard in (
            1,
            3,
            1001,
            1003,
            2 * chunk // size,
            2 * chunk // size + 5,
            3 * chunk // size + 7,
        ):
            torch.manual_seed(rank * 7 + shard)
            inp = _with_specials(torch.randn(shard).to(dtype)) if shard > 4 else torch.randn(shard)
            inp = inp.to(dtype)
            native = torch.empty(world * shard, dtype=dtype)
            dist.all_gather_into_tensor(native, inp)
            mine = torch.full((world * shard,), 7.0, dtype=dtype)
            transport.all_gather(mine, inp)
            out[f"ag {dtype} {shard}"] = torch.equal(_bits(mine), _bits(native))
            # in place: the input already is this rank's part of the output
            mine = torch.full((world * shard,), 7.0, dtype=dtype)
            mine.view(world, shard)[rank] = inp
            transport.all_gather(mine, mine.view(world, shard)[rank])
            out[f"ag in place {dtype} {shard}"] = torch.equal(_bits(mine), _bits(native))
            # row by row: three members split after 3 elements, one of them empty
            if shard > 4:
                flat = torch.full((world * shard,), 7.0, dtype=dtype)
                rows = [
                    flat[: world * 3].view(world, 3),
                    flat[world * 3 : world * 3].view(world, 0),
                    flat[world * 3 :].view(world, shard - 3),
                ]
                rows[0][rank], rows[2][rank] = inp[:3], inp[3:]
                for _ in range(2):  # the second time from the cached plan
                    transport.all_gather_rows(rows)
                grid = native.view(world, shard)
                expect = torch.cat([grid[:, :3].flatten(), grid[:, 3:].flatten()])
                out[f"ag rows {dtype} {shard}"] = torch.equal(_bits(flat), _bits(expect))
            # the reduce-scatter: gloo's order of additions (over two ranks, one addition);
            # values over six decades, so that another order would round differently
            torch.manual_seed(100 + rank + shard)
            pack = torch.randn(world * shard) * torch.logspace(-3, 3, world * shard) * 7.0**rank
            pack = pack.to(dtype)
            pack[:1] = -0.0 if rank else 0.0
            native_rs = torch.empty(shard, dtype=dtype)
            dist.reduce_scatter_tensor(native_rs, pack.clone())
            mine_rs = torch.full((shard,), 7.0, dtype=dtype)
            kept = pack.clone()
            transport.reduce_scatter(mine_rs, pack)
            out[f"rs {dtype} {shard}"] = torch.equal(_bits(mine_rs), _bits(native_rs))
            out[f"rs input kept {dtype} {shard}"] = torch.equal(_bits(pack), _bits(kept))
            # every element order-sensitive: reduced on another rank, it would differ
            probe = torch.full((world * shard,), _shm.order_probe(world, dtype)[rank], dtype=dtype)
            dist.reduce_scatter_tensor(native_rs, probe.clone())
            transport.reduce_scatter(mine_rs, probe)
            out[f"rs probe {dtype} {shard}"] = torch.equal(_bits(mine_rs), _bits(native_rs))
    out["ring order checked"] = transport.ring_order
    out["chunks equal on every rank"] = transport.chunks
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_shm_collectives_equal_gloo_bit_for_bit(run_ranks, world):
    results = run_ranks(world, shm_matches_gloo)
    chunks = {r.pop("chunks equal on every rank") for r in results}
    assert len(chunks) == 1 and chunks.pop() > 10  # several ops of several chunks each
    for out in results:
        assert out and not [k for k, ok in out.items() if not ok]


def mismatched_collectives():
    transport, rank, _ = _world_transport()
    errors = []
    n = 100 if rank == 0 else 200  # rank 1 gathers another size
    try:
        transport.all_gather(torch.empty(2 * n), torch.ones(n))
    except _shm.ShmCollectiveError as exc:
        errors.append(str(exc))
    try:  # the transport is unusable from now on
        transport.all_gather(torch.empty(2), torch.ones(1))
    except _shm.ShmCollectiveError as exc:
        errors.append(str(exc))
    return errors


def test_mismatched_collective_fails_with_a_clear_error(run_ranks):
    for errors in run_ranks(2, mismatched_collectives):
        assert len(errors) == 2, errors
        assert "ran another collective" in errors[0] and "same order" in errors[0]
        assert "failed earlier" in errors[1] and "HYPERFSDP_SHM=0" in errors[1]


def absent_peer(dead_peer: bool):
    import torch.distributed as dist

    transport, rank, _ = _world_transport(timeout=60.0 if dead_peer else 1.5)
    result = None
    if rank == 0:
        if dead_peer:  # rank 1's process "exits": point its pid at one that has
            done = subprocess.Popen([sys.executable, "-c", "pass"])
            done.wait()
            transport._pids = {1: done.pid}
        start = time.monotonic()
        try:
            transport.all_gather(torch.empty(8), torch.ones(4))
        except _shm.ShmCollectiveError as exc:
            result = (str(exc), time.monotonic() - start)
    dist.barrier()  # rank 1 never joins the collective
    return result


@pytest.mark.parametrize("dead_peer", [False, True])
def test_absent_peer_times_out_and_exited_peer_fails_fast(run_ranks, dead_peer):
    message, waited = run_ranks(2, absent_peer, dead_peer)[0]
    if dead_peer:
        assert "group rank 1" in message and "exited" in message, message
        assert waited < 10  # found by the liveness check, not the 60 s timeout
    else:
        assert "timed out after 1.5 s waiting for group rank 1" in message, message
        assert 1.5 <= waited < 10


def zombie_peer():
    """Rank 0 waits for a peer whose process exited but was not reaped (a zombie:
    ``os.kill(pid, 0)`` still succeeds), as ranks joined in order by their launcher are."""
    import torch.distributed as dist

    transport, rank, _ = _world_transport(timeout=30.0)
    result = None
    if rank == 0:
        zombie = subprocess.Popen([sys.executable, "-c", "pass"])
        deadline = time.monotonic() + 10
        while _shm._alive(zombie.pid) and time.monotonic() < deadline:  # exited, not reaped
            time.sleep(0.01)
        os.kill(zombie.pid, 0)  # still there: a zombie
        transport._pids = {1: zombie.pid}
        start = time.monotonic()
        try:
            transport.all_gather(torch.empty(8), torch.ones(4))
        except _shm.ShmCollectiveError as exc:
            result = (str(exc), time.monotonic() - start)
        zombie.wait()
    dist.barrier()  # rank 1 never joins the collective
    return result


def test_zombie_peer_fails_fast(run_ranks):
    message, waited = run_ranks(2, zombie_peer, timeout=120)[0]
    assert "group rank 1" in message and "exited" in message, message
    assert waited < 10  # found by the liveness check, not the 30 s timeout


def setup_with_absent_peer():
    """Rank 0 sets the transport up over a group whose other member never joins (it failed
    before its setup): the exchange of the segments' names times out, before rank 0 made
    its segment file, and gloo's error says what failed."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    rank = dist.get_rank()
    error, created = None, []
    if rank == 0:
        with created_segments() as created:
            try:
                _shm.ShmGroup.create(group, 0, 2, timedelta(seconds=2))
            except Exception as exc:  # gloo's timeout
                error = (type(exc).__name__, getattr(exc, "__notes__", []))
    dist.barrier()
    dist.destroy_process_group(group)
    return error, len(created), [p for p in created if os.path.exists(p)]


def test_setup_that_fails_leaves_no_segment_file(run_ranks):
    error, made, left = run_ranks(2, setup_with_absent_peer, timeout=120)[0]
    assert error is not None  # the setup failed
    _, notes = error
    assert any(
        "hyperfsdp-shm: setting up the shared-memory transport of the group (ranks [0, 1]) "
        "failed while exchanging the segments' names" in n
        for n in notes
    ), notes
    assert made == 0 and left == []


def root_transport(model):
    """The shared-memory plugin's transport of ``model``'s root (public API only)."""
    from hyperfsdp_shm.plugin import ROOT_TRANSPORT

    from hyperfsdp_core.plugin import unit_of

    return unit_of(model).root.stash[ROOT_TRANSPORT]


def deciding_makes_no_transport():
    """Asking whether a unit's gathers run in line (the prefetch decision) never makes the
    shared-memory group: making it is a collective, run only by a collective."""
    from hyperfsdp_shm._transport import ShmTransport
    from torch import nn

    from hyperfsdp_core import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    fully_shard(model[0])
    fully_shard(model)
    fresh = ShmTransport()  # no collective has run on it yet
    asked = fresh.gathers_in_line(None)
    made_by_asking = len(fresh._shm)
    model(torch.randn(2, 8)).sum().backward()  # the gathers make the root's
    made = root_transport(model)
    return asked, made_by_asking, [made.gathers_in_line(group) for group in made._shm]


def test_deciding_to_prefetch_makes_no_transport(run_ranks):
    for asked, made, in_line in run_ranks(2, deciding_makes_no_transport, timeout=120):
        assert (asked, made) == (False, 0)
        assert in_line == [True]  # once a gather made the group's transport


def setup_leaves_no_files(refuse_on_rank: int | None, how: str = "unsupported"):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    saved, saved_fallocate = _shm.supported, _shm.os.posix_fallocate
    if rank == refuse_on_rank:  # this member cannot map shared memory
        if how == "unsupported":
            _shm.supported = lambda: False
        else:  # its /dev/shm is full
            _shm.os.posix_fallocate = full
    try:
        with created_segments() as created:
            transport = _shm.ShmGroup.create(None, rank, world, timedelta(seconds=30))
    finally:
        _shm.supported, _shm.os.posix_fallocate = saved, saved_fallocate
    return transport is not None, [p for p in created if os.path.exists(p)], len(created)


@pytest.mark.parametrize(
    "refuse_on_rank, how", [(None, ""), (1, "unsupported"), (1, "/dev/shm full")]
)
def test_members_agree_and_no_segment_file_outlives_setup(run_ranks, refuse_on_rank, how):
    results = run_ranks(2, setup_leaves_no_files, refuse_on_rank, how)
    # every member decides the same: all use shared memory, or none (gloo stays)
    assert {used for used, _, _ in results} == {refuse_on_rank is None}
    for rank, (_, left, made) in enumerate(results):
        assert left == []
        assert made == (0 if rank == refuse_on_rank and how == "unsupported" else 1)


def reads_group_timeout():
    from hyperfsdp_core.plugin import group_timeout

    return group_timeout(None).total_seconds()


def test_transport_waits_as_long_as_the_process_group(run_ranks):
    from hyperfsdp_core.testing import DEFAULT_TIMEOUT

    assert run_ranks(2, reads_group_timeout) == [DEFAULT_TIMEOUT] * 2


def reduce_scatter_path(ring_order_holds: bool):
    from hyperfsdp_shm import _transport as coll
    from torch import nn

    from hyperfsdp_core import fully_shard
    from hyperfsdp_core.plugin import GlooTransport

    called = []
    # the core's gloo routes, which the plugin's transport falls back to
    sites = ((coll, "reduce_scatter_shm"), (GlooTransport, "reduce_scatter"))
    saved = [getattr(m, n) for m, n in sites] + [_shm.ShmGroup.check_ring_order]

    def spy(name, fn):
        def call(*args, **kwargs):
            called.append(name)
            return fn(*args, **kwargs)

        return call

    for (m, n), fn in zip(sites, saved):
        setattr(m, n, spy(n, fn))
    if not ring_order_holds:  # as if this gloo cut its ring differently
        _shm.ShmGroup.check_ring_order = lambda self: False
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        fully_shard(model[0])
        fully_shard(model)
        model(torch.randn(2, 8)).sum().backward()
        (transport,) = root_transport(model)._shm.values()
        return sorted(set(called)), transport.ring_order
    finally:
        for (m, n), fn in zip(sites, saved):
            setattr(m, n, fn)
        _shm.ShmGroup.check_ring_order = saved[-1]


@pytest.mark.parametrize("ring_order_holds", [True, False])
def test_reduce_scatter_over_four_ranks_needs_gloos_order(run_ranks, ring_order_holds):
    # over more than two ranks the transport reduce-scatters only where its order of
    # additions was checked equal to gloo's on the group; otherwise gloo's all-reduce stays
    for called, checked in run_ranks(4, reduce_scatter_path, ring_order_holds):
        assert checked is ring_order_holds
        expect = "reduce_scatter_shm" if ring_order_holds else "reduce_scatter"
        assert called == [expect]
