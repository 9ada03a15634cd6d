"""Reading a checkpoint whole, in one process: full tensors for inference or inspection, and a single .npz."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from axond.checkpoint.metadata import CheckpointError, dtype_from_name
from axond.checkpoint.sharded import local_slices
from axond.checkpoint.storage import check_files, read_metadata, read_piece
from axond.nn.utils import save_checkpoint


def load_full(path: str | os.PathLike[str], prefix: str = "model") -> dict[str, np.ndarray]:
    """Every tensor under `prefix` ("" for all) assembled whole, keyed without the prefix. No process group needed."""
    p = Path(path)
    meta = read_metadata(p)
    check_files(p, meta)
    lead = f"{prefix}/" if prefix else ""
    out: dict[str, np.ndarray] = {}
    for key, t in meta.tensors.items():
        if not key.startswith(lead):
            continue
        dtype = dtype_from_name(t.dtype)
        full = np.empty(t.shape, dtype)
        covered = 0
        for piece in t.pieces:
            full[local_slices(piece.box, (0,) * len(t.shape)) + (Ellipsis,)] = read_piece(p, piece, dtype, key)
            covered += int(np.prod(piece.box[1]))
        if covered < int(np.prod(t.shape)):
            raise CheckpointError(f"checkpoint {p} lacks part of {key!r}; it is incomplete")
        out[key[len(lead):]] = full
    if not out:
        raise CheckpointError(f"checkpoint {p} has no tensors under {prefix!r}; its sections are "
                              f"{sorted({k.split('/', 1)[0] for k in meta.tensors})}")
    return out


def export(path: str | os.PathLike[str], out: str | os.PathLike[str], prefix: str = "model") -> str:
    """Write the full tensors under `prefix` of the checkpoint at `path` to one .npz file `out` (atomically).

    The names are the unwrapped model's, so `model.load_state_dict(np.load(out))` works on a plain
    model in a single process, e.g. for inference.
    """
    save_checkpoint(out, load_full(path, prefix))
    return str(out)
