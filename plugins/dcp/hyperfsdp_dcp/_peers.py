"""Which peers of a save are gone: the processes of the ranks on this host are checked.

When a save's collectives fail, the survivors learn which ranks are lost from reports they
leave in the checkpoint directory (``_io.peer_lost``); a rank that never reports may be
dead, or alive and still blocked on a survivor (it notices only at its own timeout). A
rank whose process ran on this host (same host name and PID namespace, learnt when the
save began) is known dead as soon as its process has exited, so the survivors need not
wait out that timeout for it; ranks elsewhere are vouched for by their host's survivors.
"""

from __future__ import annotations

import os
import socket

#: where a process runs: ranks with the same place can check each other's PIDs
Place = tuple[str, str]


def place() -> Place:
    """This process's host name and PID namespace."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return socket.gethostname(), namespace


def identity() -> tuple[Place, int]:
    return place(), os.getpid()


def exited(pid: int) -> bool:
    """Whether process ``pid`` (of this host and PID namespace) has exited: it is gone, or
    a zombie (exited, not yet reaped by its parent, as launchers that join ranks in order
    leave them)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False  # no /proc: that it exists is all we can tell
    # "pid (comm) state ...": comm may hold spaces and parentheses; the state follows the last ")"
    end = stat.rfind(b")")
    return stat[end + 2 : end + 3] in (b"Z", b"X")


def dead_here(peers: list[tuple[Place, int]] | None, ranks) -> dict[int, int]:
    """Of ``ranks``, those whose process ran on this host and has exited: ``{rank: pid}``."""
    if not peers:
        return {}
    here = place()
    out = {}
    for r in ranks:
        where, pid = peers[r]
        if where == here and pid != os.getpid() and exited(pid):
            out[r] = pid
    return out
