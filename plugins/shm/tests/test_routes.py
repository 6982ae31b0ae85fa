"""The routes of the plugin's transport (``_transport.py``): shared memory gives gloo's own
results bit for bit, in training too, and each size and layout of all-gather takes its
route. (The core's gloo routes, which the transport extends: ``tests/test_gloo_routes.py``.)"""

import os

import pytest

from hyperfsdp_core.testing.counting import (
    all_gather_routes_taken,
    train_every_gather_layout,
    trainings_match,
)

#: the core's switches (read at each root's lazy init)
NATIVE, MIN_BYTES = "HYPERFSDP_GLOO_NATIVE_COLLECTIVES", "HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES"


def restore_env(saved: dict) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def root_transport(model):
    """The plugin's transport of ``model``'s root (None: torch.distributed's own)."""
    from hyperfsdp_shm.plugin import ROOT_TRANSPORT

    from hyperfsdp_core.plugin import unit_of

    return unit_of(model).root.stash.get(ROOT_TRANSPORT, None)


def train_with_gloo_collectives(shm: bool, subgroup: bool = False):
    """``shm``: the plugin's shared memory; else gloo's own (``HYPERFSDP_GLOO_NATIVE_COLLECTIVES``)."""
    from hyperfsdp_shm import _settings as coll

    saved = {k: os.environ.get(k) for k in (NATIVE, MIN_BYTES)}
    os.environ[NATIVE] = "0" if shm else "1"
    os.environ[MIN_BYTES] = "0"  # every size
    saved_shm, coll.SHM = coll.SHM, shm
    try:
        out = train_every_gather_layout(subgroup)
    finally:
        restore_env(saved)
        coll.SHM = saved_shm
    transport = root_transport(out["model"])
    used_shm = transport is not None and any(t is not None for t in transport._shm.values())
    return out["losses"], out["params"], out["kinds"], (transport is not None, used_shm)


def shm_training_is_exact(subgroup=False):
    return trainings_match(train_with_gloo_collectives, subgroup)


@pytest.mark.parametrize("world, subgroup", [(2, False), (4, False), (4, True)])
def test_training_through_shared_memory_equals_native_bit_for_bit(run_ranks, world, subgroup):
    # blocks 0 and 1 gather row by row (all members on dim 0; block 1 in bf16), block 2
    # (dim-1 members) into a staging buffer, all through shared memory; subgroup: FSDP over
    # pairs of ranks
    for losses, params, counts, on, off in run_ranks(world, shm_training_is_exact, subgroup):
        assert (losses, params, counts, on, off) == (True, True, True, (True, True), (False, False))


def all_gather_algorithm_by_size():
    from hyperfsdp_shm import _settings
    from hyperfsdp_shm import _transport as coll

    from hyperfsdp_core.plugin import Transport

    # torch.distributed's own and the plugin's
    sites = [
        (Transport, "all_gather", "native"),
        (coll, "all_gather_shm", "shm"),
        (coll, "all_gather_rows_shm", "rows shm"),
    ]
    saved = {MIN_BYTES: os.environ.get(MIN_BYTES)}, _settings.SHM
    os.environ[MIN_BYTES] = "4096"  # between the small unit's size and the others'
    _settings.SHM = True
    try:
        return all_gather_routes_taken(sites, rows=("rows shm",))
    finally:
        restore_env(saved[0])
        _settings.SHM = saved[1]


def test_all_gather_algorithm_by_size_and_layout(run_ranks):
    # every size through shared memory, row by row (dim 0) or into the staging buffer (a
    # dim-1 member)
    for calls in run_ranks(2, all_gather_algorithm_by_size):
        assert calls == [("rows shm", 2304), ("rows shm", 16640), ("shm", 16640)], calls


def test_environment_switches_are_read_when_a_root_transport_is_made(monkeypatch):
    """``HYPERFSDP_SHM``, ``HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES`` and
    ``HYPERFSDP_GLOO_NATIVE_COLLECTIVES`` set after import still apply to the next root
    (its transport is made at its lazy init)."""
    from hyperfsdp_shm.plugin import _make

    for name in ("SHM", "GLOO_ALL_GATHER_MIN_BYTES", "GLOO_NATIVE_COLLECTIVES"):
        monkeypatch.delenv(f"HYPERFSDP_{name}", raising=False)
    default = _make()
    monkeypatch.setenv("HYPERFSDP_GLOO_ALL_GATHER_MIN_BYTES", "123")
    small = _make()
    assert (default.use_shm, default.all_gather_min_bytes) == (True, 1 << 20)
    assert (small.use_shm, small.all_gather_min_bytes) == (True, 123)
    # no transport: the core's default (its gloo routes, or gloo's own)
    monkeypatch.setenv("HYPERFSDP_SHM", "0")
    assert _make() is None
    monkeypatch.setenv("HYPERFSDP_SHM", "1")
    monkeypatch.setenv("HYPERFSDP_GLOO_NATIVE_COLLECTIVES", "1")
    assert _make() is None
