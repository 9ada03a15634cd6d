"""`async_save`: copy this rank's pieces to host memory, then write and commit them on a background thread.

The plan is agreed collectively in the caller (so training collectives are never interleaved with
the checkpoint's), then the background thread writes this rank's file and a `__{rank}.done` marker
with its piece records; rank 0 waits for every marker, writes the metadata and renames the directory
into place, and the other ranks' futures complete when they see the committed metadata. No
collective runs in the background, so the shared file system is the only channel. At most one
save per rank is in flight: a second `async_save` first waits for the previous one (bounded memory).
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from axond.checkpoint.api import ObjectCollectives, SavePlan, write_mine
from axond.checkpoint.metadata import CheckpointError, Piece
from axond.checkpoint.storage import commit, read_metadata, temp_dir
from axond.distributed.process_group import ProcessGroup
from axond.nn.device import is_cupy_array

_inflight: dict[tuple[int, int], Future[str]] = {}
_lock = threading.Lock()
_FAILED = ".failed"


def _marker(tmp: Path, rank: int) -> Path:
    return tmp / f"__{rank}.done"


def _write_marker(tmp: Path, rank: int, body: dict[str, Any]) -> None:
    part = tmp / f"__{rank}.done.part"
    with open(part, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, _marker(tmp, rank))


def _wait(what: str, ready: Any, deadline: float, failed: Path) -> None:
    while not ready():
        if failed.exists():
            raise CheckpointError(f"async checkpoint save failed on another rank: {failed.read_text()[:2000]}")
        if time.monotonic() > deadline:
            raise CheckpointError(f"async checkpoint save timed out waiting for {what}")
        time.sleep(0.01)


def _background(plan: SavePlan, target: Path, rank: int, size: int, timeout: float) -> str:
    tmp = temp_dir(target, plan.nonce)
    failed = tmp / _FAILED
    deadline = time.monotonic() + timeout
    try:
        records, nbytes = write_mine(plan, tmp, rank)
        _write_marker(tmp, rank, {"size": nbytes, "records": [[k, p.to_json()] for k, p in records]})
        if rank != 0:
            def committed() -> bool:
                try:
                    return read_metadata(target).nonce == plan.nonce
                except (CheckpointError, OSError):
                    return False

            _wait(f"rank 0 to commit {target}", committed, deadline, failed)
            return str(target)
        markers = [_marker(tmp, r) for r in range(size)]
        _wait(f"all {size} ranks' files in {tmp}", lambda: all(m.exists() for m in markers), deadline, failed)
        written = []
        for m in markers:
            body = json.loads(m.read_text())
            written.append(([(k, Piece.from_json(p)) for k, p in body["records"]], int(body["size"])))
        for m in markers:
            m.unlink()
        commit(tmp, target, plan.metadata(written))
        return str(target)
    except BaseException as e:
        if tmp.is_dir() and not failed.exists():
            failed.write_text(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def _stage(array: Any) -> np.ndarray:
    """A host copy of `array` (the training step may change the original right after async_save returns)."""
    return array.get() if is_cupy_array(array) else np.array(array, copy=True)


def async_save(state_dict: dict[str, Any], path: str | os.PathLike[str], process_group: ProcessGroup | None = None,
               *, timeout: float = 600.0) -> Future[str]:
    """Like `save`, but returns once this rank's pieces are copied to host memory; a Future completes at the commit.

    Collective at the call (the plan is agreed), then the writing overlaps training. If this rank's
    previous async save is still running, waits for it first. `future.result()` returns the path or
    raises the save's error (on every rank when any rank's part failed).
    """
    comm = ObjectCollectives(process_group)
    key = (id(comm.group), comm.rank)
    with _lock:
        previous = _inflight.get(key)
    if previous is not None:
        previous.exception(timeout=timeout)
    plan = SavePlan(state_dict, comm)
    plan.pieces = [(k, box, _stage(a)) for k, box, a in plan.pieces]
    future: Future[str] = Future()
    target = Path(path)

    def run() -> None:
        try:
            future.set_result(_background(plan, target, comm.rank, comm.size, timeout))
        except BaseException as e:
            future.set_exception(e)

    with _lock:
        _inflight[key] = future
    threading.Thread(target=run, name=f"axond-async-save-{comm.rank}", daemon=True).start()
    return future
