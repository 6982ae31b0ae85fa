"""hyperfsdp-dcp: checkpoints for hyperfsdp models on ``torch.distributed.checkpoint`` (DCP).

- :class:`CheckpointManager`: save every K steps into ``DIR/step-N``, keep the last N,
  resume from the newest complete one (model, optimizers, LR scheduler and other stateful
  objects, step, RNG states); optional ``dcp.async_save``.
- :func:`save_checkpoint` / :func:`load_checkpoint`: one checkpoint directory, saved
  atomically, loaded after checking keys, global shapes and dtypes
  (:class:`CheckpointMismatchError` names every mismatching key; nothing is loaded).
- :func:`inspect_checkpoint` / :func:`export_checkpoint` / :func:`verify_checkpoint`:
  offline, also as ``hyperfsdp ckpt inspect DIR``, ``hyperfsdp ckpt export DIR OUT`` and
  ``hyperfsdp ckpt verify DIR``.
- Loads are transactional and checked (file sizes, CRC-32 checksums recorded at save):
  :class:`CheckpointLoadError` names the checkpoint and each damaged file, and nothing is
  loaded; failed saves raise :class:`CheckpointSaveError` on every rank, naming the step and
  the failing ranks.

Checkpoints are plain DCP directories with top-level sections ``model``, ``optim``, one per
stateful object, ``trainer`` and ``rng``; any world size and layout (FSDP, HSDP, hyperfsdp or
torch FSDP2) loads any other.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._api import load_checkpoint, save_checkpoint, validate_checkpoint
    from ._errors import CheckpointLoadError, CheckpointSaveError
    from ._inspect import (
        CheckpointInfo,
        TensorInfo,
        VerifyResult,
        export_checkpoint,
        inspect_checkpoint,
        verify_checkpoint,
    )
    from ._manager import CheckpointManager
    from ._validate import CheckpointMismatchError, Mismatch

# Imported on first use: the entry point imports hyperfsdp_dcp.plugin (and so this package)
# in every process that uses hyperfsdp, and torch.distributed.checkpoint is not needed there.
_EXPORTS = {
    "CheckpointInfo": "._inspect",
    "CheckpointLoadError": "._errors",
    "CheckpointManager": "._manager",
    "CheckpointMismatchError": "._validate",
    "CheckpointSaveError": "._errors",
    "Mismatch": "._validate",
    "TensorInfo": "._inspect",
    "VerifyResult": "._inspect",
    "export_checkpoint": "._inspect",
    "inspect_checkpoint": "._inspect",
    "load_checkpoint": "._api",
    "save_checkpoint": "._api",
    "validate_checkpoint": "._api",
    "verify_checkpoint": "._inspect",
}

__all__ = [
    "CheckpointInfo",
    "CheckpointLoadError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "Mismatch",
    "TensorInfo",
    "VerifyResult",
    "export_checkpoint",
    "inspect_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "validate_checkpoint",
    "verify_checkpoint",
]
assert sorted(_EXPORTS) == __all__


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
