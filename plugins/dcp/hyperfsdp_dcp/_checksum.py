"""Content checksums of checkpoint files: written at save, checked at load and offline.

A checkpoint saved by hyperfsdp-dcp holds, beside DCP's files, ``checksums.json``: the size
and CRC-32 of every data file (``__<rank>_<n>.distcp``) and of DCP's ``.metadata``. Each
rank checksums the files it wrote itself (still in the page cache) right after the write;
the coordinator writes the sidecar into the partial directory before the rename that
publishes the checkpoint, so a checkpoint and its checksums appear together. At load, each
rank checks a share of the files (file ``i`` on rank ``i % world``), so every byte is read
once more across the job, not once per rank.

CRC-32 detects damage (truncation, flipped bits, a file from another checkpoint); it is not
a defence against deliberate tampering.
"""

from __future__ import annotations

import json
import os
import pickle
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

CHECKSUM_FILE = "checksums.json"
METADATA_FILE = ".metadata"
ALGORITHM = "crc32"
_BLOCK = 8 << 20


@attrs.frozen
class Problem:
    """One thing wrong with one file of a checkpoint."""

    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def digest(path: Path) -> dict[str, Any]:
    """``{"size", "crc32"}`` of one file."""
    crc = 0
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"size": size, ALGORITHM: f"{crc:08x}"}


def own_files(directory: Path, rank: int, coordinator: bool) -> list[str]:
    """The data files this rank wrote (DCP's file writer names them ``__<rank>_<n>.distcp``),
    plus ``.metadata`` on the coordinator."""
    prefix = f"__{rank}_"
    names = [
        p.name for p in directory.iterdir() if p.name.startswith(prefix) and p.suffix == ".distcp"
    ]
    if coordinator:
        names.append(METADATA_FILE)
    return sorted(names)


def compute(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    return {name: digest(directory / name) for name in names}


def write_sidecar(directory: Path, files: dict[str, dict[str, Any]]) -> None:
    """Write ``checksums.json`` atomically (a temporary file, then a rename)."""
    body = {"format": 1, "algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
    tmp = directory / f".{CHECKSUM_FILE}.tmp"
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, directory / CHECKSUM_FILE)


def read_sidecar(directory: Path) -> dict[str, dict[str, Any]] | None:
    """The recorded checksums, ``None`` when the checkpoint has none (saved by plain DCP or
    torch FSDP2). Raises ``ValueError`` when the file is unreadable."""
    path = directory / CHECKSUM_FILE
    if not path.exists():
        return None
    try:
        body = json.loads(path.read_text())
        files = body["files"]
        if body.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"unknown layout (algorithm {body.get('algorithm')!r})")
        return files
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"unreadable ({type(exc).__name__}: {exc})") from exc


def read_metadata(directory: Path) -> Metadata:
    """DCP's metadata; a damaged file raises ``ValueError`` saying so."""
    try:
        return dcp.FileSystemReader(directory).read_metadata()
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        AttributeError,
        ImportError,
        IndexError,
        KeyError,
        TypeError,
        OSError,
    ) as exc:  # what unpickling damage raises
        raise ValueError(f"damaged, cannot be read ({type(exc).__name__}: {exc})") from exc


def extents(metadata: Metadata) -> dict[str, int]:
    """Per data file named by the metadata, the bytes it must hold at least."""
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        need[name] = max(need.get(name, 0), int(info.offset) + int(info.length))
    return need


def check(
    directory: Path,
    metadata: Metadata,
    recorded: dict[str, dict[str, Any]] | None,
    share: tuple[int, int] = (0, 1),
    checksums: bool = True,
) -> list[Problem]:
    """Problems of the files in this rank's ``share`` ``(rank, world)``: each data file the
    metadata names must exist and be long enough (always checked: a ``stat``); with
    ``checksums`` and a sidecar, each must match its recorded size and CRC-32 (a read)."""
    need = extents(metadata)
    names = sorted(need)
    rank, world = share
    problems: list[Problem] = []
    for name in names[rank::world]:
        path = directory / name
        if not path.is_file():
            problems.append(Problem(name, "missing"))
            continue
        size = path.stat().st_size
        if name in need and size < need[name]:
            problems.append(
                Problem(
                    name,
                    f"truncated: {size} bytes, the metadata needs at least {need[name]}",
                )
            )
            continue
        if checksums and recorded is not None:
            problems += compare(directory, name, recorded)
    return problems


def compare(directory: Path, name: str, recorded: dict[str, dict[str, Any]]) -> list[Problem]:
    """The file against its recorded size and CRC-32 (reads it)."""
    expected = recorded.get(name)
    if expected is None:
        return [Problem(name, f"not listed in {CHECKSUM_FILE}")]
    try:
        actual = digest(directory / name)
    except OSError as exc:
        return [Problem(name, f"unreadable ({exc})")]
    if actual["size"] != expected.get("size"):
        return [Problem(name, f"{actual['size']} bytes, {expected.get('size')} when saved")]
    if actual[ALGORITHM] != expected.get(ALGORITHM):
        return [
            Problem(
                name,
                f"content changed since the save ({ALGORITHM} {actual[ALGORITHM]}, "
                f"{expected.get(ALGORITHM)} when saved): the file is damaged",
            )
        ]
    return []


def verify(
    directory: Path, share: tuple[int, int] = (0, 1), checksums: bool = True
) -> tuple[Metadata | None, list[Problem], bool]:
    """Check a checkpoint directory without loading it: ``(metadata, problems, has_checksums)``.

    The sidecar is read first and ``.metadata`` compared with it before it is unpickled;
    then this rank's ``share`` of the data files is checked (:func:`check`). ``metadata`` is
    ``None`` when it could not be read.
    """
    try:
        recorded = read_sidecar(directory)
    except ValueError as exc:
        return None, [Problem(CHECKSUM_FILE, str(exc))], True
    if checksums and recorded is not None:
        problems = compare(directory, METADATA_FILE, recorded)
        if problems:
            return None, problems, True
    try:
        metadata = read_metadata(directory)
    except ValueError as exc:
        return None, [Problem(METADATA_FILE, str(exc))], recorded is not None
    return metadata, check(directory, metadata, recorded, share, checksums), recorded is not None
