"""pytest plugin (entry point ``pytest11``): multi-rank fixtures for hyperfsdp tests."""

from __future__ import annotations

import pytest

from .pool import close_pools, run_on_ranks


@pytest.fixture
def run_ranks():
    """``run_ranks(world_size, fn, *args, timeout=None, **kwargs)`` -> per-rank results."""
    return run_on_ranks


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "world_size(n): the test runs on n ranks")


def pytest_sessionfinish(session, exitstatus) -> None:
    close_pools()
