"""Test support: what the plugin leaves on the host."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from . import _shm


@contextlib.contextmanager
def created_segments() -> Iterator[list[str]]:
    """Record, in the yielded list, the path of every file the plugin creates inside the
    block (its shared-memory segments), so a test can check that none is left behind."""
    created: list[str] = []
    real_open = _shm.os.open

    def spy_open(path, flags, *args):
        if flags & os.O_CREAT:
            created.append(path)
        return real_open(path, flags, *args)

    _shm.os.open = spy_open
    try:
        yield created
    finally:
        _shm.os.open = real_open
