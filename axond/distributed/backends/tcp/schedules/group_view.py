"""What a schedule runs over: a framed group with this member's place in it, the options and reusable buffers.

A `GroupView` is the whole group or, for two-level ops, a subset of it (`subset`) that runs inside one of the group's
ops on the group's own sockets: the same call and frame headers, so a mismatched or dead peer raises as in the
group, whose `run` then aborts it. Every subset shares the group's scratch buffers (one op at a time uses them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from axond.distributed.backends.tcp.options import TcpOptions
from axond.distributed.backends.tcp.transport.framing import FramedGroup

SCRATCH_VIEWS = 64
"""Typed views of the receive buffer kept for reuse (small ops ask for the same few every call)."""


class Scratch:
    """A group's reusable buffers: one to receive into, and named ones (partial sums, staging), kept across calls so
    that no op pays page faults."""

    def __init__(self) -> None:
        self._recv = np.empty(0, np.uint8)
        self._views: dict[tuple[int, np.dtype, int], np.ndarray] = {}
        self.named_buffers: dict[str, np.ndarray] = {}

    def receive(self, nbytes: int, dtype: np.dtype, count: int) -> np.ndarray:
        """A typed view of `count` elements of the receive buffer (grown to `nbytes` if needed)."""
        key = (nbytes, dtype, count)
        view = self._views.get(key)
        if view is not None:
            return view
        if self._recv.nbytes < nbytes:
            self._recv = np.empty(max(nbytes, 2 * self._recv.nbytes), np.uint8)
            self._views.clear()
        if len(self._views) >= SCRATCH_VIEWS:
            self._views.clear()
        view = self._views[key] = self._recv[:nbytes].view(dtype)[:count]
        return view

    def named(self, name: str, nbytes: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Buffer `name` as `count` elements of `dtype` (grown to `nbytes` if needed)."""
        buf = self.named_buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self.named_buffers[name] = np.empty(nbytes, np.uint8)
        return buf[:nbytes].view(dtype)[:count]

    def rolling(self, count: int, dtype: np.dtype) -> np.ndarray:
        """The buffer of forwarded partial sums."""
        return self.named("rolling", count * dtype.itemsize, dtype, count)


@dataclass(frozen=True, eq=False)
class GroupView:
    """This member's view of a framed group, or of a subset of it: its place, the options and the scratch buffers."""

    g: FramedGroup
    rank: int
    size: int
    options: TcpOptions
    oversubscribed: bool
    scratch: Scratch
    members: tuple[int, ...] = ()
    """For a subset, the group rank of each of its ranks (empty: the whole group)."""

    def subset(self, members: Sequence[int]) -> GroupView:
        """Group ranks `members` (this rank among them), numbered 0..k-1, on this group's sockets."""
        return GroupView(self.g.subset(list(members)), list(members).index(self.rank), len(members), self.options,
                    self.oversubscribed, self.scratch, tuple(members))

    def real(self, vrank: int, root: int) -> int:
        """The rank at place `vrank` of a tree rooted at `root`."""
        return (vrank + root) % self.size
