"""Pending collectives: :class:`Handle` (``wait()`` makes a result usable), :data:`READY`,
and the note a failed collective gets (:func:`describe_failure`)."""

from __future__ import annotations

import torch.distributed as dist

_NOTE = "hyperfsdp: the "


def describe_failure(error: BaseException, what) -> None:
    """Add a note to ``error`` naming the failed collective: its kind, the unit (FQN), the
    bytes and the group's ranks (the exception's type and message stay torch's or the
    transport's; the note shows in its traceback and in ``error.__notes__``)."""
    if what is None or any(n.startswith(_NOTE) for n in getattr(error, "__notes__", ())):
        return
    kind, unit, tensor, group = what
    try:
        ranks = dist.get_process_group_ranks(group) if group is not None else "default group"
    except Exception:  # the group may be gone by now
        ranks = "unknown"
    nbytes = tensor.numel() * tensor.element_size()
    error.add_note(
        f"{_NOTE}{kind} of unit {unit or '<root>'!r} ({nbytes} bytes of "
        f"{tensor.dtype}, ranks {ranks}) failed; if a peer died or stopped, its own log "
        "says why"
    )


class Handle:
    """A pending collective. ``wait()`` is idempotent.

    On CPU it wraps a work handle (``wait()`` blocks until gloo is done); on an
    accelerator an event recorded on the communication stream (``wait()`` makes the
    current stream wait for it, without blocking the host).
    """

    __slots__ = ("_done", "_event", "_module", "_what", "_work", "keepalive")

    def __init__(self, work=None, event=None, keepalive=None, module=None, what=None) -> None:
        self._work = work
        self._event = event
        self._module = module
        self._done = work is None and event is None
        self.keepalive = keepalive
        self._what = what  # (kind, unit, tensor, group), for a failure's note

    def keep_alive(self, obj) -> None:
        """Hold ``obj`` (a buffer the collective reads) until the work is done or abandoned."""
        self.keepalive = obj

    @property
    def done(self) -> bool:
        """Whether the collective has completed (it ran in line) or been waited for."""
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            try:
                self._work.wait()
            except Exception as e:
                describe_failure(e, self._what)
                raise
        if self._event is not None:
            self._module.current_stream().wait_event(self._event)
        self._done = True
        self._work = self._event = None
        self.keepalive = None
        self._what = None  # names a buffer for a failure's note: not held once done

    def abandon(self) -> None:
        """Wait, ignoring errors (used when recovering from a failed iteration)."""
        try:
            self.wait()
        except Exception:
            self._done = True
            self._work = self._event = self.keepalive = None


class Ready(Handle):
    """A handle that is always complete (local paths that issue no collective)."""

    def wait(self) -> None:
        return

    def abandon(self) -> None:
        return


#: The handle of work that is already complete.
READY = Ready()
