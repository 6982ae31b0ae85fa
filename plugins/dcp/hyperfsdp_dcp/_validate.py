"""Check a checkpoint against what is about to be loaded into, before anything is read."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ._errors import CheckpointLoadError


@attrs.frozen
class Mismatch:
    """One key that cannot be loaded as it is.

    ``fqn`` is the checkpoint key (``model.layers.0.weight``,
    ``optim.state.layers.0.weight.exp_avg``...); ``problem`` is one of ``"missing"``
    (the model has it, the checkpoint does not), ``"unexpected"`` (the reverse),
    ``"shape"``, ``"dtype"``, ``"kind"`` (a tensor on one side, another object on the
    other) or ``"section"`` (a whole section is absent from the checkpoint).
    """

    fqn: str
    problem: str
    checkpoint: str
    target: str

    def __str__(self) -> str:
        if self.problem == "missing":
            return f"{self.fqn}: missing from the checkpoint (the target has {self.target})"
        if self.problem == "unexpected":
            return f"{self.fqn}: in the checkpoint ({self.checkpoint}), not in the target"
        if self.problem == "section":
            return f"{self.fqn}: no such section in the checkpoint (it has {self.checkpoint})"
        what = {"shape": "global shape", "dtype": "dtype", "kind": "kind"}[self.problem]
        return (
            f"{self.fqn}: {what} {self.checkpoint} in the checkpoint, {self.target} in the target"
        )


class CheckpointMismatchError(CheckpointLoadError, ValueError):
    """The checkpoint does not match the model, optimizer or stateful objects; nothing was loaded.

    ``mismatches`` lists every offending key (:class:`Mismatch`). A
    :class:`CheckpointLoadError` (and, as before, a ``ValueError``).
    """

    def __init__(self, path: str, mismatches: list[Mismatch]) -> None:
        self.mismatches = list(mismatches)
        lines = "\n".join(f"  {m}" for m in self.mismatches)
        n = len(self.mismatches)
        CheckpointLoadError.__init__(
            self,
            f"checkpoint {path} does not match what it is loaded into ({n} "
            f"mismatch{'es' if n != 1 else ''}); nothing was loaded, the model and optimizer "
            f"are unchanged:\n{lines}\n"
            "Build the model (and optimizer) exactly as the one that saved the checkpoint: same "
            "parameters, global shapes and dtypes (`hyperfsdp ckpt inspect "
            f"{path}` lists them), or load a checkpoint saved from this model.",
            path=path,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.mismatches))


def _describe(md: Any) -> str:
    if isinstance(md, TensorStorageMetadata):
        return f"tensor {tuple(md.size)} {_dtype(md.properties.dtype)}"
    return "a non-tensor object"


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {_dtype(value.dtype)}"
    return f"a {type(value).__name__}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def find_mismatches(
    target: Mapping[str, Any], metadata: Metadata, sections: Iterable[str]
) -> list[Mismatch]:
    """Every key of ``target`` (flattened) that the checkpoint cannot fill, and every tensor of
    the checkpoint's ``sections`` that ``target`` lacks, sorted by key.

    Global shapes (a DTensor's logical shape, never its local shard) and dtypes must be
    equal; keys are compared as DCP stores them.
    """
    stored = metadata.state_dict_metadata
    stored_sections = sorted({k.split(".", 1)[0] for k in stored})
    out: list[Mismatch] = []
    for section in sorted(set(sections)):
        prefix = section + "."
        if not any(k.startswith(prefix) or k == section for k in stored):
            out.append(Mismatch(section, "section", ", ".join(stored_sections) or "nothing", ""))
            continue
        for key, value in target.items():
            if not (key.startswith(prefix) or key == section):
                continue
            md = stored.get(key)
            if md is None:
                out.append(Mismatch(key, "missing", "", _describe_value(value)))
            elif isinstance(value, torch.Tensor) != isinstance(md, TensorStorageMetadata):
                out.append(Mismatch(key, "kind", _describe(md), _describe_value(value)))
            elif isinstance(value, torch.Tensor):
                assert isinstance(md, TensorStorageMetadata)
                if tuple(md.size) != tuple(value.shape):
                    out.append(Mismatch(key, "shape", str(tuple(md.size)), str(tuple(value.shape))))
                elif md.properties.dtype != value.dtype:
                    out.append(
                        Mismatch(key, "dtype", _dtype(md.properties.dtype), _dtype(value.dtype))
                    )
        for key, md in stored.items():
            if (
                (key.startswith(prefix) or key == section)
                and key not in target
                and isinstance(md, TensorStorageMetadata)
            ):
                out.append(Mismatch(key, "unexpected", _describe(md), ""))
    return sorted(out, key=lambda m: m.fqn)
