"""CheckpointManager: save every K steps, keep the last N, resume from the newest complete one."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from hyperfsdp_core.plugin import group_timeout

from . import _io
from ._errors import CheckpointLoadError
from ._state import RNG, TRAINER, TrainState, rank_key, rng_state, trainer_section


class CheckpointManager:
    """Periodic, atomic, resumable checkpoints of a training loop, in ``root/step-N``.

    ::

        manager = CheckpointManager("ckpt", model=model, optimizer=optim,
                                    stateful={"scheduler": scheduler}, every=100, keep_last=3)
        step = manager.resume()          # 0 when there is no checkpoint yet
        while step < total_steps:
            train_one_step(step)
            step += 1
            manager.maybe_save(step)     # saves when step % every == 0
        manager.close()                  # waits for (and commits) an async save

    Every rank must make the same calls (they are collective); ``root`` must be a directory
    every rank sees (a shared filesystem). A checkpoint holds the model, the optimizers,
    each ``stateful`` object (anything with ``state_dict()``/``load_state_dict()``: LR
    schedulers, data loaders...), the step, and each rank's RNG states (restored when the
    world size is unchanged). It is an ordinary DCP directory (see ``hyperfsdp_dcp``'s
    module documentation for its layout).

    :param every: ``maybe_save(step)`` saves when ``step % every == 0``; ``None`` never.
    :param keep_last: how many complete checkpoints to keep (older ones are deleted after
        each save); ``None`` keeps all.
    :param async_save: write with ``dcp.async_save`` (the state is copied to host memory, then
        written by a background thread over a dedicated gloo group); the next save, ``wait()``,
        ``resume()`` and ``close()`` wait for it and commit it.
    :param process_group: the ranks that save together (default: the default group).
    :param timeout: how long to wait for a peer: the timeout of the dedicated async-save
        group's collectives, and the most the manager waits for an async write in flight when
        it exits after a failure. Default: ``process_group``'s own timeout
        (``init_process_group(timeout=)``), so that a dead or stopped rank holds the job no
        longer than the training collectives would.
    :param verify: check each data file's CRC-32 (recorded at save) before loading it; the
        sizes are always checked.
    :param options: ``StateDictOptions`` for ``get_state_dict``/``set_state_dict``.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        model: nn.Module,
        optimizer: Any = None,
        stateful: Mapping[str, Any] | None = None,
        every: int | None = None,
        keep_last: int | None = None,
        async_save: bool = False,
        save_rng: bool = True,
        process_group: dist.ProcessGroup | None = None,
        timeout: timedelta | None = None,
        verify: bool = True,
        options: StateDictOptions | None = None,
    ) -> None:
        if every is not None and every < 1:
            raise ValueError(
                f"CheckpointManager: every={every}; pass a positive step count or None"
            )
        if keep_last is not None and keep_last < 1:
            raise ValueError(
                f"CheckpointManager: keep_last={keep_last}; pass a positive count or None (keep all)"
            )
        self.root = Path(root)
        self.state = TrainState(model, optimizer, stateful, options)
        self.every = every
        self.keep_last = keep_last
        self.save_rng = save_rng
        self.group = process_group
        self.async_save = async_save
        if timeout is None:
            timeout = group_timeout(process_group) if dist.is_initialized() else timedelta(0)
        self.timeout = timeout
        self.verify = verify
        self._async_group: dist.ProcessGroup | None = None
        if async_save and dist.is_initialized():
            # Background writes must not share a process group with training collectives.
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            self._async_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        self._pending: _io.PendingSave | None = None

    # -- paths and listing ----------------------------------------------------------------------
    def path(self, step: int) -> Path:
        return self.root / f"step-{int(step)}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk (partial and unfinished ones are ignored)."""
        return _io.list_checkpoints(self.root).steps

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving -----------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return self.every is not None and step > 0 and step % self.every == 0

    def maybe_save(self, step: int) -> bool:
        """Save when ``step`` is a multiple of ``every``; returns whether a save started."""
        if not self.should_save(step):
            return False
        self.save(step)
        return True

    def save(self, step: int) -> None:
        """Save now, as ``root/step-<step>`` (replacing one of the same step).

        Synchronous saves are visible when this returns. Async saves are committed by the
        next ``save``/``wait``/``resume``/``close``. On failure (on any rank) every rank
        raises :class:`CheckpointSaveError` and no ``step-<step>`` appears.
        """
        self.wait()
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1

        def build() -> dict[str, Any]:
            me = rank_key(self.group)
            state = self.state.collect(me)
            state[TRAINER] = trainer_section(step, world)
            if self.save_rng:
                state[RNG] = {me: rng_state()}
            return state

        pending, state = _io.begin_save(self.path(step), build, self.group, step)
        if self.async_save and self._async_group is not None:
            try:
                _io.write_async(pending, state, self.group, self._async_group)
            except _io.FAILURES as exc:
                _io.commit(pending, exc, self.group)  # raises on every rank
            self._pending = pending
            return
        _io.write(pending, state, self.group, self._prune)

    def wait(self) -> Path | None:
        """Wait for the async save in flight, if any, and commit it; returns its path."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        _io.finish_async(pending, self.group, self._prune)
        return pending.final

    def _prune(self) -> None:
        """After a commit, on the coordinator: delete checkpoints beyond ``keep_last`` and the
        partial directories failed or killed saves left (never an incomplete ``step-N``
        directory: this manager does not write those, so it does not delete them)."""
        listing = _io.list_checkpoints(self.root)
        doomed = []
        if self.keep_last is not None:
            doomed += [listing.complete[s] for s in listing.steps[: -self.keep_last]]
        in_flight = self._pending.partial if self._pending is not None else None
        doomed += [p for p, _ in listing.ignored if _io.PARTIAL_RE.match(p.name) and p != in_flight]
        for path in doomed:
            try:
                shutil.rmtree(path)
            except OSError as exc:  # never fail a training step over housekeeping
                warnings.warn(f"hyperfsdp-dcp: could not remove {path}: {exc}", stacklevel=3)

    # -- loading ----------------------------------------------------------------------------------
    def resume(self, step: int | None = None) -> int:
        """Load the newest checkpoint that loads (or ``step``); returns its step, 0 if none.

        Every rank loads the same step (rank 0 of the group decides). Each candidate is
        checked before anything is loaded (``.metadata`` present, file sizes, checksums,
        keys, global shapes and dtypes); one that fails is skipped with a warning saying
        why, and the next older one is tried, so a damaged newest checkpoint costs the steps
        since the one before (a ``step-N`` directory without ``.metadata`` is such a damaged
        one; partial directories of unfinished saves are not candidates). When
        none loads, the newest one's error is raised (:class:`CheckpointLoadError`, or
        :class:`CheckpointMismatchError` for a model that does not match). With ``step``,
        only that checkpoint is tried.
        """
        self.wait()
        if step is None:  # damaged step-N directories (no .metadata) are skipped, with why
            listing = _io.list_checkpoints(self.root)
            candidates = sorted({*listing.complete, *listing.damaged}, reverse=True)
        else:
            candidates = [step]
        if dist.is_initialized():
            box = [candidates]
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast_object_list(box, src=src, group=self.group)
            candidates = box[0]
        if not candidates:
            return 0
        errors: list[CheckpointLoadError] = []
        for candidate in candidates:
            try:
                info = self.load(candidate)
            except CheckpointLoadError as exc:  # the same on every rank
                if step is not None:
                    raise
                errors.append(exc)
                warnings.warn(
                    f"hyperfsdp-dcp: resume skips {self.path(candidate)} (it does not load): {exc}",
                    stacklevel=2,
                )
                continue
            saved = info.get("step", candidate)
            return int(candidate if saved is None or saved < 0 else saved)
        raise errors[0]

    def load(self, step: int) -> dict[str, Any]:
        """Load ``root/step-<step>``; returns its trainer section (``step``, ``world_size``).

        Transactional (see :func:`hyperfsdp_dcp.load_checkpoint`): on failure every rank
        raises :class:`CheckpointLoadError` and nothing was changed.
        """
        return _io.load(
            self.path(step),
            self.state,
            self.group,
            restore_rng=self.save_rng,
            verify=self.verify,
        )

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for and commit the async save in flight; release the async-save group."""
        try:
            self.wait()
        finally:
            if self._async_group is not None:
                dist.destroy_process_group(self._async_group)
                self._async_group = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        # The loop failed: its peers may never reach another collective, so nothing is
        # committed. An async write in flight is let finish locally, for at most the
        # timeout (the process group's by default: its own collectives give up by then
        # when a peer is gone), so that no thread keeps writing; it stays a partial
        # directory, which resume() ignores and the next save removes.
        pending, self._pending = self._pending, None
        finished = True
        if pending is not None and pending.future is not None:
            try:
                pending.future.result(timeout=self.timeout.total_seconds())
            except FutureTimeout:  # TimeoutError on 3.11+, its own class on 3.10
                finished = False
            except _io.FAILURES:
                pass
        if finished and self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None
