"""Atomic saves and validated loads of DCP checkpoint directories.

A save writes into ``.<name>.partial`` beside its final path and is renamed to the final
path by the coordinator only after every rank has finished writing: a reader never sees a
half-written checkpoint under a final name, and a failed save leaves the previous ones
untouched. A load reads the checkpoint's metadata first and refuses, on every rank and
before any tensor is read, when keys, global shapes or dtypes do not match.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from hyperfsdp_core.plugin import group_timeout

from . import _checksum, _diagnose, _peers
from ._errors import CheckpointLoadError, CheckpointSaveError
from ._state import MODEL, OPTIM, RNG, TRAINER, TrainState, flatten, rank_key, set_rng_state
from ._validate import CheckpointMismatchError, find_mismatches

__all__ = ["CheckpointLoadError", "CheckpointSaveError"]

METADATA_FILE = ".metadata"
STEP_RE = re.compile(r"^step-(\d+)$")
PARTIAL_RE = re.compile(r"^\.(.+)\.(partial|old|failed)$")


#: How a save attempt is told apart from an earlier one of the same step (ranks make the
#: same saves in the same order, so they count alike).
_ATTEMPTS = itertools.count()


# -- names on disk ------------------------------------------------------------------------------


def partial_path(final: Path) -> Path:
    return final.parent / f".{final.name}.partial"


def is_complete(path: Path) -> bool:
    """A finished DCP checkpoint: DCP's coordinator writes ``.metadata`` last."""
    return (path / METADATA_FILE).is_file()


#: Why a ``step-N`` directory without ``.metadata`` is damaged: saves write into
#: ``.step-N.partial`` and rename it only once ``.metadata`` is there.
MISSING_METADATA = (
    "missing (deleted, or the directory was copied half-way: a save renames a checkpoint "
    "to step-N only once it is complete)"
)
NO_METADATA = f"damaged: {METADATA_FILE} {MISSING_METADATA}"


@attrs.frozen
class Listing:
    """The checkpoints under a manager's directory: ``complete`` ones, ``damaged`` ones
    (``step-N`` directories without ``.metadata``), and everything ``ignored`` on resume
    (the damaged ones and the partial directories of unfinished or failed saves), with why."""

    complete: dict[int, Path]
    ignored: list[tuple[Path, str]]
    damaged: dict[int, Path] = attrs.field(factory=dict)

    @property
    def steps(self) -> list[int]:
        return sorted(self.complete)


def list_checkpoints(root: Path) -> Listing:
    complete: dict[int, Path] = {}
    damaged: dict[int, Path] = {}
    ignored: list[tuple[Path, str]] = []
    if not root.is_dir():
        return Listing(complete, ignored, damaged)
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        match = STEP_RE.match(entry.name)
        if match:
            if is_complete(entry):
                complete[int(match.group(1))] = entry
            else:
                damaged[int(match.group(1))] = entry
                ignored.append((entry, NO_METADATA))
        elif match := PARTIAL_RE.match(entry.name):
            why = (
                "failed save (reports of its ranks)"
                if match.group(2) == "failed"
                else ("unfinished save (partial)")
            )
            ignored.append((entry, why))
    return Listing(complete, ignored, damaged)


# -- agreement between ranks -------------------------------------------------------------------


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


#: What a local step may raise and still be reported to the other ranks (DCP's
#: CheckpointException is a BaseException).
FAILURES = (Exception, CheckpointException)


class PeerLost(Exception):
    """A collective of the checkpoint code failed: a peer died, stopped or disconnected."""


def error_text(error: BaseException) -> str:
    """One line per failure; DCP's CheckpointException is unpacked into its ranks' errors."""
    if isinstance(error, CheckpointException):
        parts = []
        for rank, wrapped in sorted(error.failures.items()):
            exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "DCP reported " + "; ".join(parts)
    return f"{type(error).__name__}: {error}"


def own_failure(error: BaseException | None, rank: int) -> BaseException | None:
    """This rank's own part of ``error``: DCP raises the same ``CheckpointException`` on
    every rank, naming the ranks whose local step failed; a rank it does not name did its
    part (its outcome is no failure: the named ranks report theirs)."""
    if isinstance(error, CheckpointException):
        wrapped = error.failures.get(rank)
        return wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return error


Outcome = tuple[str | None, str | None]


def outcome(error: BaseException | None, rank: int, note: str | None = None) -> Outcome:
    """``(own, seen)``: this rank's own failure (with ``note``, what the filesystem said
    about it, first), and all it saw (DCP's report of every rank), as text."""
    if error is None:
        return None, None
    own = own_failure(error, rank)
    own_text = None if own is None else error_text(own)
    if own_text is not None and note:
        own_text = f"{note} (the error: {own_text})"
    return own_text, error_text(error)


def failures_of(outcomes: list[Outcome]) -> list[tuple[int, str]]:
    """The ranks that failed and why: those that report a failure of their own; if none
    does (a report naming ranks some other way), every rank that saw one."""
    own = [(r, o) for r, (o, _) in enumerate(outcomes) if o is not None]
    return own or [(r, seen) for r, (_, seen) in enumerate(outcomes) if seen is not None]


def gather(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """``value`` of every rank, on every rank; raises :class:`PeerLost` when a peer does
    not take part (bounded by the group's timeout)."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, value, group=group)
    except Exception as exc:
        raise PeerLost(error_text(exc)) from exc
    return out


def agree(error: BaseException | None, group: dist.ProcessGroup | None) -> list[tuple[int, str]]:
    """Every rank's outcome of a local step, gathered on every rank: ``[(rank, error)]``.

    A rank is named for its own failures only (see :func:`own_failure`). Also a barrier.
    Runs on ``group`` (whose timeout bounds it).
    """
    return failures_of(gather(outcome(error, _rank(group)), group))


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
    step: int | None = None
    grace: float = 60.0  # seconds to wait for the reports of the ranks of a failed save
    attempt: int = 0
    future: Future | None = None  # async saves
    #: every rank's place and process id, learnt when the save began (``_peers``)
    peers: list | None = None
    #: what identifies this save's ``.metadata`` (kept by the rename): whether it was committed
    fingerprint: tuple[int, int, int] | None = None

    @property
    def what(self) -> str:
        return (
            f"saving {self.final}"
            if self.step is None
            else (f"saving step {self.step} ({self.final})")
        )

    @property
    def reports(self) -> Path:
        return self.final.parent / f".{self.final.name}.failed" / str(self.attempt)


def _save_error(
    pending: PendingSave, failures: list[tuple[int, str]], tail: str
) -> CheckpointSaveError:
    ranks = sorted({r for r, _ in failures})
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    return CheckpointSaveError(
        f"{pending.what} failed on {who} ({_failures_text(failures)}); {tail}",
        step=pending.step,
        ranks=ranks,
    )


def _fingerprint(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _write_report(pending: PendingSave, rank: int, mine: str | None, dead: dict[int, int]) -> None:
    try:
        pending.reports.mkdir(parents=True, exist_ok=True)
        tmp = pending.reports / f".rank-{rank}.tmp"
        tmp.write_text(json.dumps({"error": mine, "dead": dead}))
        os.replace(tmp, pending.reports / f"rank-{rank}")
    except OSError:
        pass


def _read_report(pending: PendingSave, rank: int) -> dict[str, Any] | None:
    try:
        report = json.loads((pending.reports / f"rank-{rank}").read_text())
    except (OSError, ValueError):
        return None
    report["dead"] = {int(r): pid for r, pid in report.get("dead", {}).items()}
    return report


def peer_lost(pending: PendingSave, mine: str | None, lost: PeerLost, group) -> CheckpointSaveError:
    """The save's collectives failed (a rank died, stopped or lost its connection): find out
    which ranks are still there, through the checkpoint directory (every rank sees it).

    Each surviving rank writes a report (its own error, if any, and the ranks on its host
    whose process has exited) under ``.<name>.failed/`` and waits for the others': until
    every rank has reported or is known dead (its process on some survivor's host has
    exited), at most twice the group's timeout (a survivor blocked on another survivor that
    gave up notices only at its own timeout). The ranks that never report are the failing
    ones. Whether the coordinator committed the checkpoint before is read from the disk
    (its ``.metadata`` is this save's under the final name). Returns the error to raise,
    the same on every surviving rank.
    """
    rank, world = _rank(group), _world(group)
    others = [r for r in range(world) if r != rank]
    dead = _peers.dead_here(pending.peers, others)
    _write_report(pending, rank, mine, dead)
    deadline = time.monotonic() + pending.grace
    seen: dict[int, str | None] = {}
    while True:
        for r in range(world):
            if r not in seen and (report := _read_report(pending, r)) is not None:
                seen[r] = report.get("error")
                dead.update(report["dead"])
        waiting = [r for r in range(world) if r not in seen and r not in dead]
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
        dead.update(_peers.dead_here(pending.peers, waiting))
    silent = [r for r in range(world) if r not in seen]
    reported = [(r, text) for r, text in sorted(seen.items()) if text]
    committed = pending.fingerprint is not None and pending.fingerprint == _fingerprint(
        pending.final / METADATA_FILE
    )
    if silent:  # the survivors' own errors are most likely the lost peer's doing
        failures = [
            (
                r,
                f"its process (pid {dead[r]}) exited"
                if r in dead
                else f"no report within {pending.grace:g} s (killed, stopped or disconnected)",
            )
            for r in silent
        ]
        seen_text = _failures_text(reported) if reported else str(lost)
        tail = f"the other ranks saw: {seen_text}"
    else:
        failures = reported or [(rank, f"a collective failed: {lost}")]
        tail = f"then a collective failed: {lost}"
    if committed:
        ranks = sorted({r for r, _ in failures})
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        return CheckpointSaveError(
            f"{pending.what}: the checkpoint was committed ({pending.final} is complete: "
            "`hyperfsdp ckpt verify` checks it and resume() loads it), but then "
            f"{who} stopped answering ({_failures_text(failures)}); {tail}",
            step=pending.step,
            ranks=ranks,
            committed=True,
        )
    if rank == min(seen, default=rank) and 0 not in silent:
        shutil.rmtree(pending.partial, ignore_errors=True)
    return _save_error(
        pending,
        failures,
        f"{tail}. Nothing was committed and earlier checkpoints are intact "
        f"({pending.partial.name} is ignored on resume and removed by the next successful save)",
    )


def _text(error: BaseException | None, group: dist.ProcessGroup | None) -> str | None:
    """This rank's failure for its report after a lost peer: its own, else all it saw."""
    own, seen = outcome(error, _rank(group))
    return own or seen


def begin_save(
    final: Path,
    build: Callable[[], dict[str, Any]],
    group: dist.ProcessGroup | None,
    step: int | None = None,
) -> tuple[PendingSave, dict[str, Any]]:
    """Clear a stale partial directory and build every rank's state; fail on all ranks together."""
    pending = PendingSave(
        final,
        partial_path(final),
        step=step,
        # a survivor may only notice a lost peer up to one timeout after another one does
        grace=2 * group_timeout(group).total_seconds() + 1 if dist.is_initialized() else 0.0,
        attempt=next(_ATTEMPTS),
    )

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
    try:
        outcomes = gather((outcome(error, _rank(group)), _peers.identity()), group)
    except PeerLost as lost:
        raise peer_lost(pending, _text(error, group), lost, group) from (error or lost)
    pending.peers = [who for _, who in outcomes]
    failures = failures_of([o for o, _ in outcomes])
    if failures:
        raise _save_error(
            pending, failures, "nothing was written; earlier checkpoints are intact"
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
    """Wait for an async save on this rank, then commit it (or clean it up) on all ranks.

    The background write runs its collectives on the async-save group, whose timeout bounds
    this wait when a peer is gone.
    """
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
    """Checksum the files each rank wrote, then make the checkpoint visible under its final
    name (with ``checksums.json``), once all ranks succeeded.

    ``housekeeping`` (deleting old checkpoints) runs on the coordinator right after the
    rename; every rank returns after it.
    """
    rank = _rank(group)
    sums: dict[str, Any] = {}
    note = None
    if error is None:
        # DCP's coordinator wrote .metadata before any rank's save returned
        pending.fingerprint = _fingerprint(pending.partial / METADATA_FILE)
        try:
            sums = _checksum.compute(
                pending.partial, _checksum.own_files(pending.partial, rank, rank == 0)
            )
        except OSError as exc:
            error = exc
    elif own_failure(error, rank) is not None:  # this rank's write failed: ask the disk why
        note = _diagnose.write_failure(pending.partial, _own_paths(pending.partial, rank))
    mine = outcome(error, rank, note)
    try:
        outcomes = gather((mine, sums), group)
    except PeerLost as lost:
        raise peer_lost(pending, mine[0] or mine[1], lost, group) from (error or lost)
    failures = failures_of([o for o, _ in outcomes])
    if failures:
        _on_coordinator(group, lambda: shutil.rmtree(pending.partial, ignore_errors=True))
        try:
            agree(None, group)  # nobody returns before the partial files are gone
        except PeerLost as lost:
            raise peer_lost(pending, mine[0] or mine[1], lost, group) from (error or lost)
        raise _save_error(
            pending,
            failures,
            "the partial files were removed and earlier checkpoints are intact",
        ) from error
    recorded: dict[str, Any] = {}
    for _, part in outcomes:
        recorded.update(part)

    def rename() -> None:
        if not is_complete(pending.partial):
            raise CheckpointSaveError(f"{pending.partial} has no {METADATA_FILE} after the save")
        _checksum.write_sidecar(pending.partial, recorded)
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

    error = _on_coordinator(group, rename)
    try:
        failures = agree(error, group)
    except PeerLost as lost:
        raise peer_lost(pending, mine[0] or mine[1], lost, group) from lost
    if failures:
        raise _save_error(pending, failures, "committing it failed; earlier checkpoints are intact")


def _own_paths(directory: Path, rank: int) -> list[Path]:
    """The files this rank was writing into ``directory`` (none if it cannot be listed)."""
    try:
        return [directory / n for n in _checksum.own_files(directory, rank, rank == 0)]
    except OSError:
        return []


# -- loading --------------------------------------------------------------------------------------


def read_metadata(path: Path) -> Metadata:
    check_present(path)
    try:
        return _checksum.read_metadata(path)
    except ValueError as exc:
        problem = _checksum.Problem(METADATA_FILE, str(exc))
        raise CheckpointLoadError(
            _damaged_text(path, [problem]), path=path, problems=[problem]
        ) from exc


def check_present(path: Path) -> None:
    """A finished checkpoint directory is there (its files are not looked at)."""
    if not path.is_dir():
        raise CheckpointLoadError(f"no checkpoint directory at {path}", path=path)
    if not is_complete(path):
        problem = _checksum.Problem(METADATA_FILE, MISSING_METADATA)
        raise CheckpointLoadError(
            f"{path} is not a complete checkpoint: {problem}; load an earlier one",
            path=path,
            problems=[problem],
        )


def _damaged_text(path: Path, problems: list[_checksum.Problem]) -> str:
    lines = "".join(f"\n  {p}" for p in problems)
    n = len(problems)
    return (
        f"cannot load checkpoint {path}: {n} damaged file{'s' if n != 1 else ''}:{lines}\n"
        "Nothing was loaded: the model and optimizer are unchanged. Load an earlier "
        "checkpoint (CheckpointManager.resume() does so by itself); `hyperfsdp ckpt verify "
        f"{path}` checks a checkpoint without loading it."
    )


def _staging(state: Any) -> Any:
    """A copy of a state dict's containers whose tensors are fresh, uninitialized tensors of
    the same kind (a DTensor stays a DTensor with the same mesh and placements): DCP reads
    into these, and the live tensors are only written once everything was read."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: _staging(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_staging(v) for v in state]
    return state


def load(
    path: Path,
    state: TrainState,
    group: dist.ProcessGroup | None,
    *,
    restore_rng: bool,
    verify: bool = True,
) -> dict[str, Any]:
    """Check, read, then apply ``path`` to ``state``; returns the trainer section (or ``{}``).

    Transactional: the files are checked (sizes always, checksums with ``verify``), keys,
    shapes and dtypes validated, and every tensor and object read into fresh memory before
    anything is written into the model, the optimizers, the stateful objects or the RNG.
    Any failure raises on every rank with all of them exactly as they were.
    """
    metadata: Metadata | None = None
    problems: list[_checksum.Problem] = []
    error: BaseException | None = None
    try:
        check_present(path)
        metadata, problems, _ = _checksum.verify(path, (_rank(group), _world(group)), verify)
    except CheckpointLoadError as exc:
        error = exc
        problems = list(exc.problems)
    except Exception as exc:
        error = exc
    outcomes = gather((None if error is None else error_text(error), problems), group)
    everyone = sorted({p for _, ps in outcomes for p in ps}, key=lambda p: p.file)
    if everyone:
        raise CheckpointLoadError(_damaged_text(path, everyone), path=path, problems=everyone)
    failures = [(r, e) for r, (e, _) in enumerate(outcomes) if e is not None]
    if failures:
        raise CheckpointLoadError(
            f"cannot load {path} ({_failures_text(failures)})", path=path
        ) from error
    assert metadata is not None

    stored = metadata.state_dict_metadata
    me = rank_key(group)
    target, fresh, chosen = state.template(list(stored), me)
    try:
        mismatches = find_mismatches(flatten(target), metadata, target.keys())
        failures = agree(
            CheckpointMismatchError(str(path), mismatches) if mismatches else None, group
        )
        if failures:
            if mismatches:
                raise CheckpointMismatchError(str(path), mismatches)
            raise CheckpointLoadError(f"cannot load {path} ({_failures_text(failures)})", path=path)

        staged = {k: (_staging(v) if k in (MODEL, OPTIM) else v) for k, v in target.items()}
        trainer = {k.split(".", 1)[1]: None for k in stored if k.startswith(TRAINER + ".")}
        if trainer:
            staged[TRAINER] = trainer
        rng_prefix = f"{RNG}.{me}."
        rng = {k[len(rng_prefix) :]: None for k in stored if k.startswith(rng_prefix)}
        if restore_rng and rng:
            staged[RNG] = {me: rng}
        error = None
        decoded: dict[str, Any] = {}
        try:
            dcp.load(staged, storage_reader=dcp.FileSystemReader(path), process_group=group)
            decoded = state.decode(staged, chosen)
        except FAILURES as exc:
            error = exc
        failures = agree(error, group)
        if failures:
            raise CheckpointLoadError(
                f"cannot load checkpoint {path}: reading it failed ({_failures_text(failures)}). "
                "Nothing was loaded: the model and optimizer are unchanged.",
                path=path,
            ) from error
    except BaseException:
        for opt in fresh:  # get_state_dict initialized them; leave them as they were
            opt.state.clear()
        raise

    # everything is read: apply it
    state.apply(staged, decoded)
    info = dict(staged.get(TRAINER, {}))
    saved_world = info.get("world_size")
    if restore_rng and any(k.startswith(RNG + ".") for k in stored):
        if RNG in staged and saved_world == _world(group):
            set_rng_state(staged[RNG][me])
        else:
            warnings.warn(
                f"hyperfsdp-dcp: {path} was saved by {saved_world} ranks and is "
                f"loaded by {_world(group)}: RNG states are not restored",
                stacklevel=3,
            )
    return info
