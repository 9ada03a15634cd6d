"""The interface of a path: the four data ops, the barrier, and the prepared forms a path may keep."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from axond.distributed.backends.host_copy import large_copy
from axond.distributed.backends.tcp.policy import Path
from axond.distributed.backends.tcp.schedules import doubling
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.numerics.reduce_op import ReduceOp

MakeCall = Callable[[int], Call]
"""Makes a prepared op's `Call` from its sequence number (only when a wait is long or fails)."""


class DataPath(ABC):
    """How one member runs ops along one path. Arrays are flat and contiguous (all_gather's `out`: (size, ...)),
    except where a method says; every method runs inside the group's `FramedGroup.run`."""

    kind: ClassVar[Path]
    """Which path of `policy.Path` this is."""

    def __init__(self, comm: GroupView) -> None:
        self.comm = comm

    @property
    def prepares_through(self) -> Any:
        """The mailbox this path's prepared forms run through (they are dropped when it changes), or None: it keeps
        none."""
        return None

    def takes(self, op: int, nbytes: int) -> bool:
        """Whether op `op` on `nbytes` per rank can run here (the policy listed this path for it)."""
        return True

    @abstractmethod
    def all_reduce(self, c: Call, x: np.ndarray, op: ReduceOp) -> None:
        """x <- the reduction over the group."""

    @abstractmethod
    def broadcast(self, c: Call, x: np.ndarray, src: int) -> None:
        """x <- group rank `src`'s x."""

    def all_gather(self, c: Call, out: np.ndarray, x: np.ndarray) -> None:
        """out <- every member's x (x: any layout, not yet in row `rank`)."""
        own_row(out, x, self.comm.rank)
        self.gather_rows(c, out)

    @abstractmethod
    def gather_rows(self, c: Call, out: np.ndarray) -> None:
        """out <- every member's row `rank`; this member's is in place."""

    @abstractmethod
    def reduce_scatter(self, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        """out <- block `rank` (of size blocks) of the reduction of every member's src."""

    def barrier(self, c: Call) -> None:
        """Return once every member entered the barrier (here: recursive doubling over the sockets)."""
        doubling.recursive_doubling(self.comm, c, np.zeros(1, np.uint8), ReduceOp.MAX)

    def prepare_all_reduce(self, c: Call, x: np.ndarray, op: ReduceOp, make_call: MakeCall) -> Any:
        """The prepared form of this all_reduce (its `run(flat x, seq)`), or None: this path keeps none."""
        return None

    def prepare_broadcast(self, c: Call, x: np.ndarray, src: int, make_call: MakeCall) -> Any:
        """As `prepare_all_reduce`, for a broadcast (`run(flat x, seq)`)."""
        return None

    def prepare_all_gather(self, c: Call, x: np.ndarray, make_call: MakeCall) -> Any:
        """As `prepare_all_reduce`, for an all_gather (`run(out, seq, x)`)."""
        return None

    def prepare_reduce_scatter(self, c: Call, src: np.ndarray, per: int, op: ReduceOp, make_call: MakeCall) -> Any:
        """As `prepare_all_reduce`, for a reduce_scatter of `per` elements a block (`run(flat src, flat out, seq)`)."""
        return None

    def prepare_barrier(self, c: Call, make_call: MakeCall) -> Any:
        """As `prepare_all_reduce`, for a barrier (`run(seq)`)."""
        return None


def own_row(out: np.ndarray, x: np.ndarray, rank: int) -> None:
    """Row `rank` of `out` <- x."""
    if x.ndim:
        large_copy(out[rank], x)  # a fresh out= sits 16 bytes after x modulo the page: see host_copy
    else:
        out[rank] = x
