"""hyperfsdp-dcp: checkpoints for hyperfsdp models on ``torch.distributed.checkpoint`` (DCP).

- :class:`CheckpointManager`: save every K steps into ``DIR/step-N``, keep the last N,
  resume from the newest complete one (model, optimizers, LR scheduler and other stateful
  objects, step, RNG states); optional ``dcp.async_save``.
- :func:`save_checkpoint` / :func:`load_checkpoint`: one checkpoint directory, saved
  atomically, loaded after checking keys, global shapes and dtypes
  (:class:`CheckpointMismatchError` names every mismatching key; nothing is loaded).
- :func:`inspect_checkpoint` / :func:`export_checkpoint`: offline, also as
  ``hyperfsdp ckpt inspect DIR`` and ``hyperfsdp ckpt export DIR OUT``.

Checkpoints are plain DCP directories with top-level sections ``model``, ``optim``, one per
stateful object, ``trainer`` and ``rng``; any world size and layout (FSDP, HSDP, hyperfsdp or
torch FSDP2) loads any other.
"""

from ._api import load_checkpoint, save_checkpoint, validate_checkpoint
from ._inspect import CheckpointInfo, TensorInfo, export_checkpoint, inspect_checkpoint
from ._io import CheckpointLoadError, CheckpointSaveError
from ._manager import CheckpointManager
from ._validate import CheckpointMismatchError, Mismatch

__all__ = [
    "CheckpointInfo",
    "CheckpointLoadError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "Mismatch",
    "TensorInfo",
    "export_checkpoint",
    "inspect_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "validate_checkpoint",
]
