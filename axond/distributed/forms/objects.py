"""Collectives of Python objects, with torch.distributed's signatures; `src`/`dst` are GLOBAL ranks.

These pickle, so they are for small Python objects (configs, metrics, shapes, file names), not
arrays: move arrays with the array collectives (`broadcast`, `all_gather`, ...), which never pickle.
Unpickling runs code chosen by the peer that pickled, so these are only safe because the data plane
accepts only authenticated members of the job (the handshake over the job secret).

Each op moves the pickled lengths first (int64), then the bytes as one uint8 array padded to the
longest, through the group's array collectives, so it works on every backend. A rank whose object
cannot be pickled sends the length -1: it raises `TypeError`, its peers raise `DistributedError`
naming it, and the group stays usable.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from axond.distributed.api import _group
from axond.distributed.process_group import ProcessGroup
from axond.errors import DistributedError

__all__ = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"]

_FAILED = -1
"""The length a rank sends for an object it could not pickle."""

_Naming = Callable[[list[int]], str]
"""Says whose objects failed, given their indices in the lengths array."""


def _where(op: str, g: ProcessGroup) -> str:
    return f"{op} on group '{g.name}' (rank {g.rank} of {g.size})"


def _check_list(where: str, name: str, value: Any, size: int) -> list[Any]:
    """`value` as a list of `size` elements, or an error saying what to pass (before any communication)."""
    if value is None:
        raise ValueError(f"{where}: {name} is None; pass a list of {size} elements, e.g. [None] * {size}")
    if not isinstance(value, list):
        raise TypeError(f"{where}: {name} must be a list of {size} elements, got {type(value).__name__}")
    if len(value) != size:
        raise ValueError(f"{where}: {name} has {len(value)} elements but must have {size} (one per group member); "
                         f"pass e.g. [None] * {size}")
    return value


def _pickle(objs: Sequence[Any]) -> tuple[list[bytes], np.ndarray, Exception | None]:
    """Each object pickled (b"" if it cannot be: a pickle is never empty), the lengths (int64, _FAILED for
    those) and the first error."""
    data: list[bytes] = []
    error: Exception | None = None
    for obj in objs:
        try:
            data.append(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # PicklingError, TypeError (locks, sockets), AttributeError (local objects), ...
            data.append(b"")
            error = error or e
    return data, np.array([len(d) or _FAILED for d in data], np.int64), error


def _raise_unpicklable(op: str, g: ProcessGroup, lengths: np.ndarray, mine: Exception | None, whose: _Naming) -> None:
    """If a length is _FAILED: TypeError on the rank that could not pickle, DistributedError on the others."""
    failed = [int(i) for i in np.flatnonzero(lengths == _FAILED)]
    if not failed:
        return
    if mine is not None:
        raise TypeError(f"{_where(op, g)}: {whose(failed)} could not be pickled ({type(mine).__name__}: {mine}); "
                        "these ops carry picklable Python objects only (no lambdas, locks, sockets, open files): "
                        "drop such fields, or send arrays with the array collectives") from mine
    raise DistributedError(f"{_where(op, g)}: {whose(failed)} could not be pickled, so nothing was exchanged "
                           "(that rank raised TypeError saying why)", op=op, group=g.name, rank=g.rank)


def _of_ranks(g: ProcessGroup) -> _Naming:
    return lambda failed: f"the object of global rank(s) {[g.global_rank_of(r) for r in failed]}"


def _padded(data: Sequence[bytes], width: int) -> np.ndarray:
    """The byte strings as the rows of a (len(data), width) uint8 array, zero-padded."""
    out = np.zeros((len(data), width), np.uint8)
    for row, d in zip(out, data):
        row[: len(d)] = np.frombuffer(d, np.uint8)
    return out


def _host(a: Any) -> np.ndarray:
    """A collective's result as NumPy (the nccl backend returns CuPy to ranks that passed no array)."""
    get = getattr(a, "get", None)
    return np.asarray(get() if get is not None else a)


def _unpickle(op: str, g: ProcessGroup, group_rank: int, buf: np.ndarray) -> Any:
    try:
        return pickle.loads(buf.tobytes())
    except Exception as e:
        peer = g.global_rank_of(group_rank)
        raise DistributedError(f"{_where(op, g)}: could not unpickle the object of global rank {peer} "
                               f"({type(e).__name__}: {e}); is everything it references importable on this rank?",
                               op=op, group=g.name, rank=g.rank, peer=peer) from e


def broadcast_object_list(object_list: list[Any], src: int = 0, group: ProcessGroup | None = None) -> None:
    """Replace the elements of `object_list` by those of global rank `src` (the lists have one length everywhere)."""
    op, g = "broadcast_object_list", _group(group)
    root = g.group_rank(src)
    if not isinstance(object_list, list):
        raise TypeError(f"{_where(op, g)}: object_list must be a list (of the same length on every rank), "
                        f"got {type(object_list).__name__}")
    if g.rank == root:
        data, sizes, error = _pickle(object_list)
    else:
        data, sizes, error = [], np.zeros(len(object_list), np.int64), None
    g.broadcast(sizes, root)
    _raise_unpicklable(op, g, sizes, error, lambda failed: f"object_list{failed} of global rank {src} (src)")
    buf = np.frombuffer(bytearray(b"".join(data)), np.uint8) if g.rank == root else np.empty(int(sizes.sum()), np.uint8)
    if buf.size:
        g.broadcast(buf, root)
    if g.rank != root:
        ends = np.cumsum(sizes)
        object_list[:] = [_unpickle(op, g, root, buf[end - n : end]) for n, end in zip(sizes, ends)]


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """Fill `object_list` (one slot per member) with every member's `obj`, in group-rank order."""
    op, g = "all_gather_object", _group(group)
    out = _check_list(_where(op, g), "object_list", object_list, g.size)
    data, length, error = _pickle([obj])
    lengths = _host(g.all_gather(length)).reshape(-1)
    _raise_unpicklable(op, g, lengths, error, _of_ranks(g))
    rows = _host(g.all_gather(_padded(data, int(lengths.max()))[0]))
    out[:] = [_unpickle(op, g, r, rows[r, :n]) for r, n in enumerate(lengths)]


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0,
                  group: ProcessGroup | None = None) -> None:
    """On global rank `dst`, fill `object_gather_list` (one slot per member) with every member's `obj`.

    The other ranks pass None (a list there is left alone).
    """
    op, g = "gather_object", _group(group)
    root = g.group_rank(dst)
    out = None
    if g.rank == root:
        out = _check_list(f"{_where(op, g)} on the dst rank", "object_gather_list", object_gather_list, g.size)
    data, length, error = _pickle([obj])
    lengths = _host(g.all_gather(length)).reshape(-1)
    _raise_unpicklable(op, g, lengths, error, _of_ranks(g))
    rows = g.gather(_padded(data, int(lengths.max()))[0], root)
    if out is not None:
        rows = _host(rows)
        out[:] = [_unpickle(op, g, r, rows[r, :n]) for r, n in enumerate(lengths)]


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None,
                        src: int = 0, group: ProcessGroup | None = None) -> None:
    """Set `scatter_object_output_list[0]` to this rank's element of global rank `src`'s input list.

    The input list has one object per member, in group-rank order; the other ranks pass None.
    """
    op, g = "scatter_object_list", _group(group)
    root = g.group_rank(src)
    if not isinstance(scatter_object_output_list, list):
        raise TypeError(f"{_where(op, g)}: scatter_object_output_list must be a list (its [0] receives this rank's "
                        f"object), got {type(scatter_object_output_list).__name__}; pass [None]")
    if not scatter_object_output_list:
        raise ValueError(f"{_where(op, g)}: scatter_object_output_list is empty; pass [None] (its [0] receives "
                         "this rank's object)")
    if g.rank == root:
        inputs = _check_list(f"{_where(op, g)} on the src rank", "scatter_object_input_list",
                             scatter_object_input_list, g.size)
        data, sizes, error = _pickle(inputs)
    else:
        data, sizes, error = [], np.zeros(g.size, np.int64), None
    g.broadcast(sizes, root)
    _raise_unpicklable(op, g, sizes, error,
                       lambda failed: f"scatter_object_input_list{failed} of global rank {src} (src)")
    row = _host(g.scatter(_padded(data, int(sizes.max())) if g.rank == root else None, root))
    scatter_object_output_list[0] = _unpickle(op, g, root, row[: sizes[g.rank]])
