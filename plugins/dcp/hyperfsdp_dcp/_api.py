"""One-off checkpoint functions: save, load and check a single DCP directory."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from . import _io
from ._state import RNG, TRAINER, TrainState, flatten, rank_key, rng_state, trainer_section
from ._validate import Mismatch, find_mismatches


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: Any = None,
    *,
    stateful: Mapping[str, Any] | None = None,
    step: int | None = None,
    save_rng: bool = False,
    process_group: dist.ProcessGroup | None = None,
    options: StateDictOptions | None = None,
) -> Path:
    """Save ``model`` (and optimizers, stateful objects) to the DCP directory ``path``, atomically.

    Collective: every rank of ``process_group`` calls it. The files are written into a
    partial directory beside ``path`` and renamed to ``path`` once every rank has finished; on
    failure on any rank all ranks raise :class:`CheckpointSaveError` (naming ``step`` and the
    failing ranks; a rank that died or stopped is found within the group's timeout) and
    ``path`` is left as it was (a previous checkpoint there is only replaced by a successful
    save). Each rank records the CRC-32 of the files it wrote in ``checksums.json``.
    """
    state = TrainState(model, optimizer, stateful, options)
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1

    def build() -> dict[str, Any]:
        me = rank_key(process_group)
        out = state.collect(me)
        out[TRAINER] = trainer_section(step, world)
        if save_rng:
            out[RNG] = {me: rng_state()}
        return out

    final = Path(path)
    pending, sections = _io.begin_save(final, build, process_group, step)
    _io.write(pending, sections, process_group)
    return final


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: Any = None,
    *,
    stateful: Mapping[str, Any] | None = None,
    restore_rng: bool = False,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """Load the DCP directory ``path`` into ``model`` (and optimizers, stateful objects).

    Any world size and any data-parallel layout (FSDP, HSDP; hyperfsdp or torch FSDP2)
    loads any other: DCP reads the rows each rank owns. Keys, global shapes and dtypes are
    checked first; a mismatch raises :class:`CheckpointMismatchError` naming every offending
    key, on every rank, with nothing loaded.

    Transactional: the data files are checked first (each must be as long as the metadata
    says; with ``verify``, the default, each must match the CRC-32 recorded at save in
    ``checksums.json``), then everything is read into fresh memory, and only then written
    into the model, optimizers and stateful objects. A damaged or unreadable checkpoint
    raises :class:`CheckpointLoadError` on every rank naming the checkpoint, each damaged
    file and what is wrong with it; the model and optimizers are then exactly as before.
    ``verify=False`` skips the checksums (not the sizes). Returns the checkpoint's ``trainer`` section
    (``step``, ``world_size``), or ``{}`` for a checkpoint written without one (for example by
    a plain FSDP2 program that saved ``{"model": ..., "optim": ...}``).
    """
    state = TrainState(model, optimizer, stateful, options)
    return _io.load(Path(path), state, process_group, restore_rng=restore_rng, verify=verify)


def validate_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: Any = None,
    *,
    stateful: Mapping[str, Any] | None = None,
    options: StateDictOptions | None = None,
) -> list[Mismatch]:
    """The keys of ``path`` that could not be loaded into these objects (empty: it fits).

    Local (no collective). Reads only the checkpoint's metadata. An optimizer without state is
    left without state.
    """
    metadata = _io.read_metadata(Path(path))
    state = TrainState(model, optimizer, stateful, options)
    target, fresh, _ = state.template(list(metadata.state_dict_metadata), rank_key(None))
    try:
        return find_mismatches(flatten(target), metadata, target.keys())
    finally:
        for opt in fresh:
            opt.state.clear()
