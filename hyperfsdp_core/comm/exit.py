"""Let gloo's worker threads release their last tensors before the interpreter finalizes.

Why this exists (issue 30 item 7, docs/design.md "An abort at exit"): a gloo work object is
referenced by the process group's worker thread that ran it, which drops that reference
*after* completing the work, so after the main thread's ``wait()`` has already returned.
When that drop is the last reference, the work's destructor runs on the worker thread and
releases the work's tensors; a tensor that has a Python object needs the GIL for that
(``TensorImpl::decref_pyobject``, taken when a C++ reference count goes from 2 to 1). If the
main thread keeps the GIL from the moment the collective completes until
``Py_FinalizeEx`` marks the interpreter as finalizing, the worker's GIL request makes
CPython 3.11 end the thread with ``pthread_exit``; the forced unwind meets the work's
``noexcept`` destructor and the C++ runtime calls ``std::terminate`` ("terminate called
without an active exception", SIGABRT). Torch's functional collectives (DTensor's
``full_tensor()``, redistributions) hit it most, because their works are released by
``wait_tensor`` in C++ with no Python work object whose deallocation would hand the GIL
over; any gloo collective can.

The remedy needs no private torch API: an ``atexit`` handler (run before the interpreter is
marked finalizing) releases the GIL in short sleeps until no other thread of the process is
runnable for a few rounds in a row. A worker blocked on the GIL is woken by each release, so
it is runnable (``R`` in ``/proc/self/task/*/stat``) until it has taken the GIL and finished;
the wait ends when every thread is asleep again, or after ``_MAX_WAIT_S``. A process with
one thread, or one that never imported ``torch.distributed``, returns at once.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

_MAX_WAIT_S = 0.5
_STEP_S = 0.002
_QUIET_ROUNDS = 3
_installed = False


def _other_runnable_threads(own: int) -> int | None:
    """How many threads of this process other than ``own`` are runnable; None without /proc."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    runnable = 0
    for tid in tids:
        if int(tid) == own:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        # "pid (comm) S ...": the state follows the last ')' (comm may contain one)
        if stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"R":
            runnable += 1
    return runnable


def drain_native_threads(max_wait_s: float = _MAX_WAIT_S) -> float:
    """Release the GIL until no other thread is runnable for a few rounds; returns seconds waited."""
    if "torch.distributed" not in sys.modules:
        return 0.0
    start = time.monotonic()
    own = threading.get_native_id()
    try:
        if len(os.listdir("/proc/self/task")) <= 1:
            return 0.0
    except OSError:
        time.sleep(0.02)  # no /proc: one plain hand-over of the GIL
        return time.monotonic() - start
    quiet = 0
    while quiet < _QUIET_ROUNDS and time.monotonic() - start < max_wait_s:
        time.sleep(_STEP_S)  # releases the GIL: a worker waiting for it takes it now
        quiet = quiet + 1 if not _other_runnable_threads(own) else 0
    return time.monotonic() - start


def install_exit_drain() -> None:
    """Register the drain once per process (idempotent)."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(drain_native_threads)
