"""Offline views of checkpoints (no process group): inspect the metadata, export a full state dict."""

from __future__ import annotations

import os
import re
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from . import _checksum, _io
from ._state import MODEL, TRAINER

_RANK_FILE = re.compile(r"^__(\d+)_")
BATCH_BYTES = 256 << 20


@attrs.frozen
class TensorInfo:
    """One tensor of a checkpoint: its global shape and dtype and the chunks that hold it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks_per_rank: tuple[tuple[int, int], ...]  # (writing rank, number of chunks); -1: unknown
    chunk_numels: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@attrs.frozen
class CheckpointInfo:
    """What ``hyperfsdp ckpt inspect`` shows."""

    path: Path
    tensors: tuple[TensorInfo, ...]
    objects: tuple[str, ...]  # keys of non-tensor items
    disk_bytes: int
    trainer: dict[str, Any]
    steps: tuple[int, ...]  # complete checkpoints beside it (a manager directory), else ()
    ignored: tuple[tuple[str, str], ...]  # (name, why) of partial/incomplete ones

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "trainer": self.trainer,
            "steps": list(self.steps),
            "ignored": [list(i) for i in self.ignored],
            "disk_bytes": self.disk_bytes,
            "tensors": [
                {
                    "key": t.key,
                    "shape": list(t.shape),
                    "dtype": str(t.dtype).replace("torch.", ""),
                    "bytes": t.nbytes,
                    "chunks_per_rank": {str(r): n for r, n in t.chunks_per_rank},
                    "chunk_numels": list(t.chunk_numels),
                }
                for t in self.tensors
            ],
            "objects": list(self.objects),
        }


def resolve(path: str | os.PathLike, step: int | None = None) -> tuple[Path, _io.Listing | None]:
    """A checkpoint directory, from itself or from a manager directory (newest, or ``step``)."""
    path = Path(path)
    if _io.is_complete(path) and step is None:
        return path, None
    listing = _io.list_checkpoints(path)
    if step is not None:
        if step not in listing.complete:
            raise _io.CheckpointLoadError(
                f"{path} has no complete checkpoint for step {step} "
                f"(complete steps: {listing.steps or 'none'})"
            )
        return listing.complete[step], listing
    if not listing.complete:
        why = "".join(f"\n  {p.name}: {reason}" for p, reason in listing.ignored)
        raise _io.CheckpointLoadError(
            f"{path} is neither a DCP checkpoint (no {_io.METADATA_FILE}) nor a directory of "
            f"complete step-N checkpoints{why}"
        )
    return listing.complete[listing.steps[-1]], listing


def _ranks_of(metadata: Metadata) -> dict[str, Counter]:
    out: dict[str, Counter] = {}
    for index, info in (metadata.storage_data or {}).items():
        match = _RANK_FILE.match(str(getattr(info, "relative_path", "")))
        out.setdefault(index.fqn, Counter())[int(match.group(1)) if match else -1] += 1
    return out


def _load_local(state: dict[str, Any], path: Path) -> None:
    """``dcp.load`` in this process alone (DCP warns about that even when asked to)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)


def read_trainer(path: Path, metadata: Metadata) -> dict[str, Any]:
    keys = [k for k in metadata.state_dict_metadata if k.startswith(TRAINER + ".")]
    if not keys:
        return {}
    section = {k.split(".", 1)[1]: None for k in keys}
    state = {TRAINER: section}
    _load_local(state, path)
    return dict(state[TRAINER])


def inspect_checkpoint(path: str | os.PathLike, step: int | None = None) -> CheckpointInfo:
    """Describe a checkpoint (or the newest complete one of a manager directory) from its metadata."""
    ckpt, listing = resolve(path, step)
    metadata = dcp.FileSystemReader(ckpt).read_metadata()
    ranks = _ranks_of(metadata)
    tensors, objects = [], []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            numels = []
            for chunk in md.chunks:
                n = 1
                for d in chunk.sizes:
                    n *= d
                numels.append(n)
            tensors.append(
                TensorInfo(
                    key=key,
                    shape=tuple(md.size),
                    dtype=md.properties.dtype,
                    chunks_per_rank=tuple(sorted(ranks.get(key, Counter()).items())),
                    chunk_numels=tuple(numels),
                )
            )
        else:
            objects.append(key)
    disk = sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file())
    return CheckpointInfo(
        path=ckpt,
        tensors=tuple(tensors),
        objects=tuple(objects),
        disk_bytes=disk,
        trainer=read_trainer(ckpt, metadata),
        steps=tuple(listing.steps) if listing else (),
        ignored=tuple((p.name, why) for p, why in listing.ignored) if listing else (),
    )


def format_info(info: CheckpointInfo) -> str:
    def shape(s: tuple[int, ...]) -> str:
        return "x".join(map(str, s)) or "()"

    lines = [f"checkpoint: {info.path}"]
    if info.trainer:
        lines.append(
            f"step {info.trainer.get('step')}, saved by {info.trainer.get('world_size')} ranks"
        )
    if info.steps:
        lines.append(f"steps present: {', '.join(map(str, info.steps))}")
    for name, why in info.ignored:
        lines.append(f"ignored: {name} ({why})")
    total = sum(t.nbytes for t in info.tensors)
    lines.append(
        f"{len(info.tensors)} tensors, {_human(total)} of tensor data, "
        f"{_human(info.disk_bytes)} on disk; {len(info.objects)} other items"
    )
    rows = [("tensor", "global shape", "dtype", "chunks per rank", "bytes")]
    for t in info.tensors:
        per_rank = " ".join(f"r{r}:{n}" if r >= 0 else f"?:{n}" for r, n in t.chunks_per_rank)
        rows.append(
            (t.key, shape(t.shape), str(t.dtype).replace("torch.", ""), per_rank, str(t.nbytes))
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if info.objects:
        lines.append("other items: " + ", ".join(info.objects))
    return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# -- export ---------------------------------------------------------------------------------------


def _batches(tensors: list[TensorInfo], limit: int) -> Iterator[list[TensorInfo]]:
    batch: list[TensorInfo] = []
    size = 0
    for t in tensors:
        if batch and size + t.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(t)
        size += t.nbytes
    if batch:
        yield batch


def safetensors_available() -> bool:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


def export_checkpoint(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    prefix: str | None = None,
    fmt: str = "auto",
    progress: bool = True,
    batch_bytes: int = BATCH_BYTES,
) -> tuple[Path, str, int]:
    """Write one full (unsharded) state dict of a checkpoint's tensors to the file ``out``.

    :param prefix: the section to export, its keys without the prefix; default ``"model"``
        when the checkpoint has one (the model's ``state_dict()`` keys), else every tensor.
        ``""`` exports every tensor under its full key.
    :param fmt: ``"safetensors"``, ``"torch"`` (``torch.save``) or ``"auto"`` (safetensors when
        installed, else torch).
    :returns: ``(out, format, number of tensors)``.
    """
    info = inspect_checkpoint(path, step)
    if fmt == "auto":
        fmt = "safetensors" if safetensors_available() else "torch"
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"export format {fmt!r}: use 'safetensors', 'torch' or 'auto'")
    if fmt == "safetensors" and not safetensors_available():
        raise ImportError(
            "exporting to safetensors needs the safetensors package: "
            "pip install hyperfsdp-dcp[safetensors] (or pass --format torch)"
        )
    if prefix is None:
        prefix = MODEL if any(t.key.startswith(MODEL + ".") for t in info.tensors) else ""
    lead = prefix + "." if prefix else ""
    chosen = [t for t in info.tensors if t.key.startswith(lead)]
    if not chosen:
        raise ValueError(
            f"{info.path} has no tensors under {prefix!r} (sections: "
            f"{', '.join(sorted({t.key.split('.', 1)[0] for t in info.tensors}))})"
        )
    from tqdm.auto import tqdm

    full: dict[str, torch.Tensor] = {}
    with tqdm(
        total=sum(t.nbytes for t in chosen),
        unit="B",
        unit_scale=True,
        desc=f"export {info.path.name}",
        disable=not progress,
    ) as bar:
        for batch in _batches(chosen, batch_bytes):
            state = {t.key: torch.empty(t.shape, dtype=t.dtype) for t in batch}
            _load_local(state, info.path)
            for t in batch:
                full[t.key[len(lead) :]] = state[t.key]
            bar.update(sum(t.nbytes for t in batch))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in full.items()}, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(full, tmp)
    os.replace(tmp, out)
    return out, fmt, len(full)


# -- verify ---------------------------------------------------------------------------------------


@attrs.frozen
class VerifyResult:
    """What ``hyperfsdp ckpt verify`` found in one checkpoint."""

    path: Path
    problems: tuple[_checksum.Problem, ...]
    has_checksums: bool  # False: saved without checksums.json (only sizes were checked)
    files: int  # data files checked

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        if self.problems:
            lines = "".join(f"\n  {p}" for p in self.problems)
            n = len(self.problems)
            return f"{self.path}: DAMAGED, {n} problem{'s' if n != 1 else ''}:{lines}"
        how = (
            "sizes and CRC-32 checksums match"
            if self.has_checksums
            else f"sizes match (no {_checksum.CHECKSUM_FILE}: saved without checksums)"
        )
        return f"{self.path}: OK, {self.files} data files, {how}"


def verify_checkpoint(
    path: str | os.PathLike, step: int | None = None, *, checksums: bool = True
) -> VerifyResult:
    """Check a checkpoint (or the newest complete one of a manager directory, or ``step``)
    without loading it: ``.metadata`` readable, every data file it names present and long
    enough, and (with ``checksums``) every file's CRC-32 equal to the one recorded at save.
    No process group needed. A ``step-N`` directory (or one holding DCP data files)
    without ``.metadata`` is damaged: its result names the missing file."""
    path = Path(path)
    if step is not None:
        damaged = _io.list_checkpoints(path).damaged.get(step)
        if damaged is not None:
            return _missing_metadata(damaged)
    elif _looks_like_checkpoint(path) and not _io.is_complete(path):
        return _missing_metadata(path)
    ckpt, _ = resolve(path, step)
    metadata, problems, has = _checksum.verify(ckpt, (0, 1), checksums)
    files = len(_checksum.extents(metadata)) if metadata is not None else 0
    return VerifyResult(ckpt, tuple(problems), has, files)


def _looks_like_checkpoint(path: Path) -> bool:
    """A directory named ``step-N``, or holding DCP data files or a checksum sidecar."""
    return path.is_dir() and bool(
        _io.STEP_RE.match(path.name)
        or (path / _checksum.CHECKSUM_FILE).is_file()
        or any(path.glob("*.distcp"))
    )


def _missing_metadata(path: Path) -> VerifyResult:
    problem = _checksum.Problem(_io.METADATA_FILE, _io.MISSING_METADATA)
    return VerifyResult(path, (problem,), (path / _checksum.CHECKSUM_FILE).is_file(), 0)
