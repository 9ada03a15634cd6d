"""`save` and `load`: every rank writes only its pieces and reads only the parts it holds.

`save` exchanges the ranks' plans (the boxes they hold), writes each distinct box once, waits
until every rank's file is durable, and lets rank 0 write the metadata and rename the directory
into place. `load` checks the state against the metadata on every rank first (missing, extra,
reshaped or retyped keys are refused, naming the first), then copies each overlap of a saved
piece with a held box straight into the live arrays, so a checkpoint loads at any world size.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from axond.checkpoint.metadata import (
    CheckpointError, LocalPlan, Metadata, Piece, TensorMeta, assign_writers, dtype_from_name, dtype_name, local_plan,
    split_state,
)
from axond.checkpoint.sharded import Box, ShardedTensor, as_sharded, intersect, iter_leaves, local_slices, set_leaf
from axond.checkpoint.storage import commit, data_file, read_metadata, read_piece, temp_dir, write_pieces
from axond.distributed.process_group import ProcessGroup
from axond.nn.device import Array, is_cupy_array
from axond.observe import timeline
from axond.distributed import default_registry as defaults
from axond.distributed.forms.objects import all_gather_object
from axond.distributed.forms.objects import broadcast_object_list


class ObjectCollectives:
    """The few collectives a checkpoint needs, on a group or (no group) on a single process."""

    def __init__(self, group: ProcessGroup | None) -> None:
        if group is None:
            group = defaults.current()
        self.group = group
        self.rank = group.rank if group is not None else 0
        self.size = group.size if group is not None else 1

    def all_gather(self, obj: Any) -> list[Any]:
        if self.group is None or self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        all_gather_object(out, obj, self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.group is None or self.size == 1:
            return obj
        box = [obj]
        broadcast_object_list(box, 0, self.group)
        return box[0]


def first_error(results: list[tuple[Any, str | None]], what: str) -> None:
    """Raise the lowest rank's error (the same on every rank), if any rank had one."""
    for rank, (_, err) in enumerate(results):
        if err:
            raise CheckpointError(err if err.startswith(what) else f"{what}: rank {rank}: {err}")


class SavePlan:
    """The agreed plan of one save: what this rank writes, and what the metadata will describe."""

    def __init__(self, state: dict[str, Any], comm: ObjectCollectives) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"axond.checkpoint.save takes a dict of state (e.g. {{'model': ..., 'optim': ...}}), "
                            f"got {type(state).__name__}")
        split, err = _guard(lambda: split_state(state))
        tensors, objects = split if split is not None else ({}, {})
        mine = local_plan(tensors, objects)
        plans: list[tuple[tuple[LocalPlan, str], str | None]] = comm.all_gather(((mine, uuid.uuid4().hex[:16]), err))
        first_error(plans, "checkpoint save")
        writes, self.shapes, self.objects = assign_writers([p for (p, _), _ in plans])
        self.nonce = plans[0][0][1]
        self.world_size = comm.size
        arrays = {(k, (c.offsets, c.lengths)): c.array for k, t in tensors.items() for c in t.chunks}
        self.pieces: list[tuple[str, Box, Array]] = [(k, box, arrays[(k, box)]) for k, box in writes[comm.rank]]

    def metadata(self, written: list[tuple[list[tuple[str, Piece]], int]]) -> Metadata:
        tensors = {k: TensorMeta(shape, dtype) for k, (shape, dtype) in self.shapes.items()}
        files: dict[str, int] = {}
        for rank, (records, size) in enumerate(written):
            files[data_file(rank)] = size
            for key, piece in records:
                tensors[key].pieces.append(piece)
        return Metadata(tensors, self.objects, files, self.world_size, time.time(), self.nonce)


def write_mine(plan: SavePlan, tmp: Path, rank: int) -> tuple[list[tuple[str, Piece]], int]:
    tmp.mkdir(parents=True, exist_ok=True)
    records, size = write_pieces(tmp, rank, plan.pieces)
    return [(rid.split("|", 1)[0], p) for rid, p in records.items()], size


def _guard(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as e:  # reported to every rank, so that all raise together
        return None, f"{type(e).__name__}: {e}"


def save(state_dict: dict[str, Any], path: str | os.PathLike[str], process_group: ProcessGroup | None = None) -> str:
    """Write `state_dict` (nested dicts of arrays, ShardedTensors and JSON values) to the directory `path`.

    Collective: every rank of `process_group` (default: the initialised world, else this process
    alone) calls it with its own shards; `path` must be on a file system they all see. Atomic: the
    checkpoint appears at `path` complete or not at all. Returns `path`.
    """
    traced = timeline.span_start() if timeline.TRACER is not None else 0
    comm = ObjectCollectives(process_group)
    target = Path(path)
    plan = SavePlan(state_dict, comm)
    tmp = temp_dir(target, plan.nonce)
    written = comm.all_gather(_guard(lambda: write_mine(plan, tmp, comm.rank)))
    if any(err for _, err in written) and comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    first_error(written, f"checkpoint save to {target} failed")
    status: tuple[Any, str | None] = (None, None)
    if comm.rank == 0:
        status = _guard(lambda: commit(tmp, target, plan.metadata([w for w, _ in written])))
    first_error([comm.broadcast(status)], f"checkpoint save to {target} failed")
    if traced and timeline.TRACER is not None:
        timeline.TRACER.since("checkpoint.save", "checkpoint", traced, path=str(target))
    return str(target)


def _copy_into(dst: Array, src: np.ndarray) -> None:
    if is_cupy_array(dst):
        import cupy

        dst[...] = cupy.asarray(src)
    else:
        dst[...] = src


def _same_kind(template: Any, value: Any) -> Any:
    """A JSON value back in the template's type (tuples, NumPy scalars)."""
    if isinstance(template, tuple) and isinstance(value, list):
        return tuple(_same_kind(t, v) for t, v in zip(template, value)) if len(template) == len(value) else tuple(value)
    if isinstance(template, np.generic):
        return type(template)(value)
    return value


def check_against(tensors: dict[str, ShardedTensor], objects: dict[str, Any], meta: Metadata, where: str) -> str | None:
    """The first mismatch between the state to load and the checkpoint, as a message, or None."""
    for key, t in tensors.items():
        saved = meta.tensors.get(key)
        if saved is None:
            kind = "a non-tensor value" if key in meta.objects else "nothing"
            return (f"checkpoint {where} does not fit: missing key {key!r} (the checkpoint holds {kind} under it); "
                    "was it saved from a different model or optimizer?")
        if tuple(saved.shape) != tuple(t.global_shape):
            return (f"checkpoint {where} does not fit: {key!r} has shape {tuple(saved.shape)} in the checkpoint, "
                    f"the state to load has {tuple(t.global_shape)}")
        if saved.dtype != dtype_name(t.dtype):
            return (f"checkpoint {where} does not fit: {key!r} has dtype {saved.dtype} in the checkpoint, "
                    f"the state to load has {dtype_name(t.dtype)}")
    for key in objects:
        if key not in meta.objects:
            return f"checkpoint {where} does not fit: missing key {key!r}"
    return None


def load(state_dict: dict[str, Any], path: str | os.PathLike[str], process_group: ProcessGroup | None = None) -> None:
    """Fill `state_dict` in place from the checkpoint at `path`, resharding to the pieces each rank holds.

    Collective. Arrays and ShardedTensor chunks are overwritten in place; non-tensor leaves are
    replaced. Every top-level section of `state_dict` (e.g. "model", "optim") must match the
    checkpoint's exactly: the first missing, unexpected, reshaped or retyped key is named in a
    CheckpointError raised on every rank before anything is copied.
    """
    if path is None:
        raise TypeError("axond.checkpoint.load needs a checkpoint path, got None (did latest(dir) find none?)")
    comm = ObjectCollectives(process_group)
    where = str(path)
    meta, err = _guard(lambda: read_metadata(path))
    tensors: dict[str, ShardedTensor] = {}
    objects: dict[str, Any] = {}
    for key, leaf in iter_leaves(state_dict):
        st = as_sharded(leaf)
        if st is not None:
            tensors[key] = st
        else:
            objects[key] = leaf
    if err is None:
        err = check_against(tensors, objects, meta, where)
    keys = list(tensors) + list(objects)
    results = comm.all_gather((keys, err))
    first_error(results, f"checkpoint {where}")
    wanted = {k for ks, _ in results for k in ks}
    sections = {k.split("/", 1)[0] for k in wanted}
    for key in list(meta.tensors) + list(meta.objects):
        if key.split("/", 1)[0] in sections and key not in wanted:
            raise CheckpointError(f"checkpoint {where} does not fit: unexpected key {key!r} (in the checkpoint, "
                                  "not in the state to load); was it saved from a different model or optimizer?")
    _, err = _guard(lambda: _read_into(Path(path), meta, tensors))
    first_error(comm.all_gather((None, err)), f"checkpoint {where}")
    for key, template in objects.items():
        set_leaf(state_dict, key, _same_kind(template, meta.objects[key]))


def _read_into(path: Path, meta: Metadata, tensors: dict[str, ShardedTensor]) -> None:
    for key, t in tensors.items():
        saved = meta.tensors[key]
        dtype = dtype_from_name(saved.dtype)
        cache: dict[int, np.ndarray] = {}
        for chunk in t.chunks:
            want = (chunk.offsets, chunk.lengths)
            covered = 0
            for i, piece in enumerate(saved.pieces):
                inter = intersect(want, piece.box)
                if inter is None:
                    continue
                if i not in cache:
                    cache[i] = read_piece(path, piece, dtype, key)
                src = cache[i][local_slices(inter, piece.box[0]) + (Ellipsis,)]
                _copy_into(chunk.array[local_slices(inter, chunk.offsets) + (Ellipsis,)], src)
                covered += int(np.prod(inter[1]))
            if covered < int(np.prod(chunk.lengths)):
                raise CheckpointError(f"checkpoint {path} lacks part of {key!r} (box {want}); it is incomplete")
