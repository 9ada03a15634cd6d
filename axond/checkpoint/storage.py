"""Files of a checkpoint directory: per-rank data files with CRC32 per piece, the metadata, the atomic commit.

Layout of a committed checkpoint `path/`: `__{rank}.distcp` (the raw bytes of the pieces that
rank wrote, back to back) and `.metadata` (JSON, see `metadata.Metadata`). Everything is written
into a sibling `.{name}.tmp-{nonce}/`, fsynced, and renamed to `path` only after the metadata is
durable; a directory without metadata, or whose files have the wrong size, is not a checkpoint.
"""

from __future__ import annotations

import os
import shutil
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from axond.checkpoint.metadata import METADATA_FILE, CheckpointError, Metadata, Piece
from axond.checkpoint.sharded import Box
from axond.nn.device import Array, is_cupy_array


def data_file(rank: int) -> str:
    return f"__{rank}.distcp"


def temp_dir(path: Path, nonce: str) -> Path:
    return path.parent / f".{path.name}.tmp-{nonce}"


def host_bytes(array: Array) -> np.ndarray:
    """The array's bytes as a flat uint8 NumPy array (copied off the GPU, or made contiguous, only if needed)."""
    host = array.get() if is_cupy_array(array) else np.asarray(array)
    return np.ascontiguousarray(host).reshape(-1).view(np.uint8)


def write_pieces(directory: Path, rank: int, pieces: Sequence[tuple[str, Box, Array]]) -> tuple[dict[str, Piece], int]:
    """Write (key, box, array) pieces to this rank's data file and fsync it; (records by key|box, file size)."""
    name = data_file(rank)
    records: dict[str, Piece] = {}
    offset = 0
    with open(directory / name, "wb") as f:
        for key, box, array in pieces:
            raw = host_bytes(array)
            f.write(raw.data)
            records[piece_id(key, box)] = Piece(name, offset, int(raw.nbytes), box, zlib.crc32(raw.data))
            offset += int(raw.nbytes)
        f.flush()
        os.fsync(f.fileno())
    return records, offset


def piece_id(key: str, box: Box) -> str:
    return f"{key}|{box[0]}|{box[1]}"


def read_piece(path: Path, piece: Piece, dtype: np.dtype[Any] | None, key: str) -> np.ndarray:
    """Read one piece and check its length and CRC32; the array has the piece's box shape (raw bytes without `dtype`)."""
    buf = np.empty(piece.nbytes, np.uint8)
    try:
        with open(path / piece.file, "rb") as f:
            f.seek(piece.offset)
            got = f.readinto(buf.data)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {piece.file} for {key!r}: {e}") from e
    if got != piece.nbytes:
        raise CheckpointError(f"checkpoint {path} is torn: {piece.file} ends before the bytes of {key!r} "
                              f"({got} of {piece.nbytes} at offset {piece.offset})")
    if zlib.crc32(buf.data) != piece.crc32:
        raise CheckpointError(f"checkpoint {path} is corrupted: the checksum of {key!r} in {piece.file} "
                              f"(offset {piece.offset}) does not match; restore it or use an older checkpoint")
    return buf if dtype is None else buf.view(dtype).reshape(piece.box[1])


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, path: Path, meta: Metadata) -> None:
    """Write the metadata into `tmp`, fsync it, and rename `tmp` to `path` (replacing an older `path`)."""
    with open(tmp / METADATA_FILE, "wb") as f:
        f.write(meta.to_bytes())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    old: Path | None = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{meta.nonce}"
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The metadata of the checkpoint at `path`, or a CheckpointError saying why it is not one."""
    p = Path(path)
    try:
        data = (p / METADATA_FILE).read_bytes()
    except FileNotFoundError:
        if p.is_dir():
            raise CheckpointError(f"{p} has no {METADATA_FILE}: it is not a complete checkpoint (a save may have "
                                  "been interrupted); use axond.checkpoint.latest(dir) to find a complete one") from None
        raise CheckpointError(f"no checkpoint at {p}") from None
    return Metadata.from_bytes(data, str(p))


def check_files(path: Path, meta: Metadata, verify: bool = False) -> None:
    """Raise CheckpointError unless every data file exists with its recorded size (and, with `verify`, every CRC matches)."""
    for name, size in meta.files.items():
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing") from None
        if actual != size:
            raise CheckpointError(f"checkpoint {path} is torn: {name} has {actual} bytes, the metadata says {size}")
    if verify:
        for key, t in meta.tensors.items():
            for piece in t.pieces:
                read_piece(path, piece, None, key)


def complete_checkpoints(directory: str | os.PathLike[str], verify: bool = False) -> list[tuple[float, str, Path]]:
    """(saved_at, name, path) of every complete checkpoint directly inside `directory`, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found: list[tuple[float, str, Path]] = []
    for child in d.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        try:
            meta = read_metadata(child)
            check_files(child, meta, verify)
        except (CheckpointError, OSError):
            continue
        found.append((meta.saved_at, child.name, child))
    return sorted(found)


def latest(directory: str | os.PathLike[str], verify: bool = False) -> str | None:
    """The newest complete checkpoint in `directory` (None if there is none).

    Complete: committed metadata and every data file at its recorded size, so interrupted saves
    (temporary directories) and torn files are skipped. `verify=True` also reads every piece and
    checks its CRC32 (reads the whole checkpoint).
    """
    found = complete_checkpoints(directory, verify)
    return str(found[-1][2]) if found else None


def remove_stale_temps(directory: Path) -> None:
    """Delete leftovers of interrupted saves (`.NAME.tmp-*` and `.NAME.old-*`) in `directory`."""
    if not directory.is_dir():
        return
    for child in directory.iterdir():
        if child.name.startswith(".") and (".tmp-" in child.name or ".old-" in child.name):
            shutil.rmtree(child, ignore_errors=True)
