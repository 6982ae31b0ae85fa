"""Atomic saves and validated loads of DCP checkpoint directories.

A save writes into ``.<name>.partial`` beside its final path and is renamed to the final
path by the coordinator only after every rank has finished writing: a reader never sees a
half-written checkpoint under a final name, and a failed save leaves the previous ones
untouched. A load reads the checkpoint's metadata first and refuses, on every rank and
before any tensor is read, when keys, global shapes or dtypes do not match.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ._state import RNG, TRAINER, TrainState, flatten, rank_key, set_rng_state
from ._validate import CheckpointMismatchError, find_mismatches

METADATA_FILE = ".metadata"
STEP_RE = re.compile(r"^step-(\d+)$")
PARTIAL_RE = re.compile(r"^\.(.+)\.(partial|old)$")


class CheckpointSaveError(RuntimeError):
    """A save failed on at least one rank; its partial files were removed (or are ignored).

    The checkpoints saved before are intact, and resuming ignores the failed one.
    """


class CheckpointLoadError(RuntimeError):
    """A checkpoint could not be read (missing, incomplete, unreadable)."""


# -- names on disk ------------------------------------------------------------------------------


def partial_path(final: Path) -> Path:
    return final.parent / f".{final.name}.partial"


def is_complete(path: Path) -> bool:
    """A finished DCP checkpoint: DCP's coordinator writes ``.metadata`` last."""
    return (path / METADATA_FILE).is_file()


@attrs.frozen
class Listing:
    """The checkpoints under a manager's directory."""

    complete: dict[int, Path]
    ignored: list[tuple[Path, str]]

    @property
    def steps(self) -> list[int]:
        return sorted(self.complete)


def list_checkpoints(root: Path) -> Listing:
    complete: dict[int, Path] = {}
    ignored: list[tuple[Path, str]] = []
    if not root.is_dir():
        return Listing(complete, ignored)
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        match = STEP_RE.match(entry.name)
        if match:
            if is_complete(entry):
                complete[int(match.group(1))] = entry
            else:
                ignored.append((entry, f"incomplete: no {METADATA_FILE}"))
        elif PARTIAL_RE.match(entry.name):
            ignored.append((entry, "unfinished save (partial)"))
    return Listing(complete, ignored)


# -- agreement between ranks -------------------------------------------------------------------


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


#: What a local step may raise and still be reported to the other ranks (DCP's
#: CheckpointException is a BaseException).
FAILURES = (Exception, CheckpointException)


def error_text(error: BaseException) -> str:
    """One line per failure; DCP's CheckpointException is unpacked into its ranks' errors."""
    if isinstance(error, CheckpointException):
        parts = []
        for rank, wrapped in sorted(error.failures.items()):
            exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "DCP reported " + "; ".join(parts)
    return f"{type(error).__name__}: {error}"


def agree(error: BaseException | None, group: dist.ProcessGroup | None) -> list[tuple[int, str]]:
    """Every rank's outcome of a local step, gathered on every rank: ``[(rank, error)]``.

    Also a barrier. Runs on ``group`` (whose timeout bounds it).
    """
    mine = None if error is None else error_text(error)
    if not dist.is_initialized():
        return [] if mine is None else [(0, mine)]
    outcomes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, mine, group=group)
    return [(r, e) for r, e in enumerate(outcomes) if e is not None]


def _failures_text(failures: list[tuple[int, str]]) -> str:
    """``rank 1: OSError: ...``; ranks that report the same error are named together."""
    by_text: dict[str, list[int]] = {}
    for rank, text in failures:
        by_text.setdefault(text, []).append(rank)
    return "; ".join(
        f"{'rank' if len(r) == 1 else 'ranks'} {', '.join(map(str, r))}: {t}"
        for t, r in by_text.items()
    )


def _on_coordinator(
    group: dist.ProcessGroup | None, fn: Callable[[], None]
) -> BaseException | None:
    if _rank(group) != 0:
        return None
    try:
        fn()
    except Exception as exc:
        return exc
    return None


# -- saving ---------------------------------------------------------------------------------------


@attrs.define
class PendingSave:
    """A save whose files are (being) written into ``partial``; committed by ``finish``."""

    final: Path
    partial: Path
    future: Future | None = None  # async saves


def begin_save(
    final: Path, build: Callable[[], dict[str, Any]], group: dist.ProcessGroup | None
) -> tuple[PendingSave, dict[str, Any]]:
    """Clear a stale partial directory and build every rank's state; fail on all ranks together."""
    pending = PendingSave(final, partial_path(final))

    def prepare() -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        if pending.partial.exists():
            shutil.rmtree(pending.partial)

    error = _on_coordinator(group, prepare)
    state: dict[str, Any] = {}
    if error is None:
        try:
            state = build()
        except Exception as exc:
            error = exc
    failures = agree(error, group)
    if failures:
        raise CheckpointSaveError(
            f"saving {final} failed before anything was written ({_failures_text(failures)}); "
            "earlier checkpoints are intact"
        ) from error
    return pending, state


def write(
    pending: PendingSave,
    state: dict[str, Any],
    group: dist.ProcessGroup | None,
    housekeeping: Callable[[], None] | None = None,
) -> None:
    """Synchronous DCP save into the partial directory, then the commit."""
    error: BaseException | None = None
    try:
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(pending.partial),
            process_group=group,
        )
    except FAILURES as exc:
        error = exc
    commit(pending, error, group, housekeeping)


def write_async(
    pending: PendingSave,
    state: dict[str, Any],
    group: dist.ProcessGroup | None,
    async_group: dist.ProcessGroup | None,
) -> None:
    """Start a ``dcp.async_save`` into the partial directory; ``commit`` it after ``wait``."""
    response = dcp.async_save(
        state,
        storage_writer=dcp.FileSystemWriter(pending.partial),
        process_group=async_group,
    )
    pending.future = getattr(response, "upload_completion", response)


def finish_async(
    pending: PendingSave,
    group: dist.ProcessGroup | None,
    housekeeping: Callable[[], None] | None = None,
) -> None:
    """Wait for an async save on this rank, then commit it (or clean it up) on all ranks."""
    error: BaseException | None = None
    assert pending.future is not None
    try:
        pending.future.result()
    except FAILURES as exc:
        error = exc
    commit(pending, error, group, housekeeping)


def commit(
    pending: PendingSave,
    error: BaseException | None,
    group: dist.ProcessGroup | None,
    housekeeping: Callable[[], None] | None = None,
) -> None:
    """Make a written checkpoint visible under its final name, once all ranks succeeded.

    ``housekeeping`` (deleting old checkpoints) runs on the coordinator right after the
    rename; every rank returns after it.
    """
    failures = agree(error, group)
    if failures:
        _on_coordinator(group, lambda: shutil.rmtree(pending.partial, ignore_errors=True))
        agree(None, group)  # nobody returns before the partial files are gone
        raise CheckpointSaveError(
            f"saving {pending.final} failed ({_failures_text(failures)}); the partial files "
            "were removed and earlier checkpoints are intact"
        ) from error

    def rename() -> None:
        if not is_complete(pending.partial):
            raise CheckpointSaveError(f"{pending.partial} has no {METADATA_FILE} after the save")
        old = pending.final.parent / f".{pending.final.name}.old"
        if pending.final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(pending.final, old)
        os.replace(pending.partial, pending.final)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
        if housekeeping is not None:
            housekeeping()

    failures = agree(_on_coordinator(group, rename), group)
    if failures:
        raise CheckpointSaveError(
            f"committing {pending.final} failed ({_failures_text(failures)}); earlier "
            "checkpoints are intact"
        )


# -- loading --------------------------------------------------------------------------------------


def read_metadata(path: Path) -> Metadata:
    if not path.is_dir():
        raise CheckpointLoadError(f"no checkpoint directory at {path}")
    if not is_complete(path):
        raise CheckpointLoadError(
            f"{path} is not a complete checkpoint (no {METADATA_FILE}: the save did not finish); "
            "load an earlier one"
        )
    return dcp.FileSystemReader(path).read_metadata()


def load(
    path: Path, state: TrainState, group: dist.ProcessGroup | None, *, restore_rng: bool
) -> dict[str, Any]:
    """Validate, then load ``path`` into ``state``; returns the trainer section (or ``{}``)."""
    metadata: Metadata | None = None
    error: BaseException | None = None
    try:
        metadata = read_metadata(path)
    except Exception as exc:
        error = exc
    failures = agree(error, group)
    if failures:
        raise CheckpointLoadError(f"cannot load {path} ({_failures_text(failures)})") from error
    assert metadata is not None

    stored = metadata.state_dict_metadata
    me = rank_key(group)
    target, fresh, chosen = state.template(list(stored), me)
    mismatches = find_mismatches(flatten(target), metadata, target.keys())
    failures = agree(CheckpointMismatchError(str(path), mismatches) if mismatches else None, group)
    if failures:
        for opt in fresh:  # get_state_dict initialized them; leave them as they were
            opt.state.clear()
        if mismatches:
            raise CheckpointMismatchError(str(path), mismatches)
        raise CheckpointLoadError(f"cannot load {path} ({_failures_text(failures)})")

    trainer = {k.split(".", 1)[1]: None for k in stored if k.startswith(TRAINER + ".")}
    if trainer:
        target[TRAINER] = trainer
    rng_prefix = f"{RNG}.{me}."
    rng = {k[len(rng_prefix) :]: None for k in stored if k.startswith(rng_prefix)}
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if restore_rng and rng:
        target[RNG] = {me: rng}
    dcp.load(target, storage_reader=dcp.FileSystemReader(path), process_group=group)
    state.restore(target, chosen)
    info = dict(target.get(TRAINER, {}))
    saved_world = info.get("world_size")
    if restore_rng and any(k.startswith(RNG + ".") for k in stored):
        if RNG in target and saved_world == world:
            set_rng_state(target[RNG][me])
        else:
            warnings.warn(
                f"hyperfsdp-dcp: {path} was saved by {saved_world} ranks and is "
                f"loaded by {world}: RNG states are not restored",
                stacklevel=3,
            )
    return info
