"""The checkpoint's metadata: every tensor's global shape and dtype and the pieces each file holds.

Planning happens before anything is written: each rank lists the boxes it holds (`local_plan`),
the plans are exchanged, and `assign_writers` gives each distinct box to the lowest rank holding
it, so replicated data (DDP replicas, HYBRID_SHARD replicas, buffers) is written once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from axond.checkpoint.sharded import Box, ShardedTensor, as_sharded, iter_leaves

FORMAT = "axond-checkpoint"
VERSION = 1
METADATA_FILE = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the state it is loaded into, or that is incomplete or corrupted."""


def dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def dtype_from_name(name: str) -> np.dtype[Any]:
    """The NumPy dtype called `name` (bfloat16 and friends through ml_dtypes)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


@dataclass
class Piece:
    """A saved box of one tensor: where its bytes sit and their checksum."""

    file: str
    offset: int
    nbytes: int
    box: Box
    crc32: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "offset": self.offset, "nbytes": self.nbytes,
                "box": [list(self.box[0]), list(self.box[1])], "crc32": self.crc32}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Piece:
        return cls(str(d["file"]), int(d["offset"]), int(d["nbytes"]),
                   (tuple(int(x) for x in d["box"][0]), tuple(int(x) for x in d["box"][1])), int(d["crc32"]))


@dataclass
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class Metadata:
    """Everything `load` needs to find any element of any tensor, and the non-tensor values."""

    tensors: dict[str, TensorMeta]
    objects: dict[str, Any]
    files: dict[str, int]
    world_size: int
    saved_at: float
    nonce: str

    def to_bytes(self) -> bytes:
        return json.dumps({
            "format": FORMAT, "version": VERSION, "world_size": self.world_size, "saved_at": self.saved_at,
            "nonce": self.nonce, "files": self.files, "objects": self.objects,
            "tensors": {k: {"shape": list(t.shape), "dtype": t.dtype, "pieces": [p.to_json() for p in t.pieces]}
                        for k, t in self.tensors.items()},
        }).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Metadata:
        try:
            d = json.loads(data)
            if d.get("format") != FORMAT:
                raise CheckpointError(f"{where} is not an axond checkpoint (format {d.get('format')!r})")
            if int(d.get("version", 0)) > VERSION:
                raise CheckpointError(f"{where} has format version {d['version']}; this axond reads up to {VERSION}")
            tensors = {k: TensorMeta(tuple(int(x) for x in t["shape"]), str(t["dtype"]),
                                     [Piece.from_json(p) for p in t["pieces"]]) for k, t in d["tensors"].items()}
            return cls(tensors, dict(d["objects"]), {str(k): int(v) for k, v in d["files"].items()},
                       int(d["world_size"]), float(d["saved_at"]), str(d["nonce"]))
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from e


@dataclass
class LocalPlan:
    """What one rank holds: per tensor (shape, dtype, boxes), and its non-tensor values."""

    tensors: dict[str, tuple[tuple[int, ...], str, list[Box]]]
    objects: dict[str, Any]


def split_state(state: dict[str, Any]) -> tuple[dict[str, ShardedTensor], dict[str, Any]]:
    """The tensor leaves (as ShardedTensors) and the other leaves of a nested state dict, by path."""
    tensors: dict[str, ShardedTensor] = {}
    objects: dict[str, Any] = {}
    for path, leaf in iter_leaves(state):
        st = as_sharded(leaf)
        if st is not None:
            tensors[path] = st
        else:
            objects[path] = to_jsonable(path, leaf)
    return tensors, objects


def to_jsonable(path: str, value: Any) -> Any:
    """A non-tensor leaf as JSON data, or a clear error naming it."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (tuple, list)):
        return [to_jsonable(path, v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: to_jsonable(f"{path}/{k}", v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"state {path!r} is a {type(value).__name__}; checkpoints hold arrays, numbers, strings, "
                          "lists and dicts of them")


def local_plan(tensors: dict[str, ShardedTensor], objects: dict[str, Any]) -> LocalPlan:
    return LocalPlan({k: (t.global_shape, dtype_name(t.dtype), [(c.offsets, c.lengths) for c in t.chunks])
                      for k, t in tensors.items()}, objects)


def assign_writers(plans: list[LocalPlan]) -> tuple[list[list[tuple[str, Box]]], dict[str, tuple[tuple[int, ...], str]], dict[str, Any]]:
    """(boxes each rank writes, every tensor's shape and dtype, the objects), identical on every rank.

    A box held by several ranks is written by the lowest; ranks disagreeing on a tensor's global
    shape or dtype are refused; an object takes the lowest rank's value.
    """
    writes: list[list[tuple[str, Box]]] = [[] for _ in plans]
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    seen: set[tuple[str, Box]] = set()
    objects: dict[str, Any] = {}
    for rank, plan in enumerate(plans):
        for key, (shape, dtype, boxes) in plan.tensors.items():
            shape = tuple(shape)
            known = shapes.setdefault(key, (shape, dtype))
            if known != (shape, dtype):
                raise CheckpointError(f"ranks disagree on {key!r}: shape/dtype {known} on a lower rank, "
                                      f"{(shape, dtype)} on rank {rank}")
            for box in boxes:
                box = (tuple(box[0]), tuple(box[1]))
                if (key, box) not in seen:
                    seen.add((key, box))
                    writes[rank].append((key, box))
        for key, value in plan.objects.items():
            objects.setdefault(key, value)
    return writes, shapes, objects
