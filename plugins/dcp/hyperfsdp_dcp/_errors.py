"""The plugin's exceptions (re-exported by ``hyperfsdp_dcp``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class CheckpointSaveError(RuntimeError):
    """A save failed on at least one rank; raised on every rank that is still running.

    ``step`` is the step being saved (``None`` for a save without one), ``ranks`` the
    ranks that failed or stopped answering (group ranks). Unless ``committed``, nothing
    was committed: the checkpoints saved before are intact, and resuming ignores the
    failed one. ``committed`` is true when the ranks were lost only after the coordinator
    committed the checkpoint: it is complete, and resuming loads it.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        ranks: Sequence[int] = (),
        committed: bool = False,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = list(ranks)
        self.committed = committed


class CheckpointLoadError(RuntimeError):
    """A checkpoint could not be loaded: missing, incomplete, damaged or unreadable.

    Raised on every rank, before anything is written into the model, the optimizers or the
    stateful objects: they are exactly as they were. ``path`` is the checkpoint directory,
    ``problems`` the damaged files (objects with ``file`` and ``what``), when known.
    """

    def __init__(self, message: str, *, path: Any = None, problems: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.path = path
        self.problems = list(problems)
