"""Why a checkpoint write failed, in the filesystem's own words.

DCP's file writer writes each item with ``torch.save``, whose zip writer loses the
``OSError`` of a failed write: a full disk or a file-size limit surfaces only as
``[enforce fail at inline_container.cc:...] unexpected pos 704 vs 598``. After a write
failed on a rank, :func:`write_failure` asks the filesystem what went wrong there: whether
one of the rank's files stopped at the process's file-size limit (``RLIMIT_FSIZE``: the
write failed with ``EFBIG``), else whether a small file can still be written next to them
(a full disk answers ``ENOSPC``, a quota ``EDQUOT``, a read-only mount ``EROFS``).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

#: the probe write: one page, as a filesystem allocates it
PROBE_BYTES = 4096


def _errno_text(code: int) -> str:
    return f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"


def _space(directory: Path) -> str:
    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return f"; its filesystem has {free} of {total} bytes free"


def _size_limit(files: Iterable[Path]) -> str | None:
    """The file of ``files`` that reached this process's file-size limit, said so."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft == resource.RLIM_INFINITY:
        return None
    for path in files:
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if size >= soft:
            return (
                f"{path} stopped at this process's file-size limit of {soft} bytes "
                f"(RLIMIT_FSIZE, `ulimit -f`; {_errno_text(errno.EFBIG)})"
            )
    return None


def _probe(directory: Path) -> str | None:
    """Write and sync one page in ``directory``: the error it fails with, said so."""
    probe = directory / f".hyperfsdp-write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            data = memoryview(bytes(PROBE_BYTES))
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        code = exc.errno or errno.EIO
        return f"writing to {directory} fails with {_errno_text(code)}{_space(directory)}"
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


def write_failure(directory: Path, files: Iterable[Path]) -> str | None:
    """What the filesystem says about a failed write of ``files`` into ``directory``, or
    ``None`` when writing there works (the failure had another cause)."""
    return _size_limit(files) or _probe(directory)
