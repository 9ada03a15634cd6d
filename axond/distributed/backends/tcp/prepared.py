"""The tcp backend's prepared small ops as runners for the group's fast path (`axond.distributed.fast_path`).

A path that keeps prepared forms (the mailbox, and the single-copy path through it: `DataPath.prepares_through`)
builds one after an op's full run (`mailbox_ops.Prepared`: the frame header, the payload views, the compiled op).
`Fresh.keep` wraps it in a runner of the op's method arguments and holds it, with the op's signature and sequence
number, until the group asks for it (`TcpBackend.prepared`). A runner numbers its call like the full way and runs
the prepared form, or returns `MISSED` having done nothing: the group's mailbox changed (the form is stale), the group
was aborted, or an array it cannot take (not contiguous, a wrong `out`), for which the full way checks and raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from axond.distributed.backends.base import MISSED
from axond.distributed.backends.tcp.paths.base import DataPath
from axond.distributed.backends.tcp.transport.framing import Call, FramedGroup
from axond.distributed.backends.tcp.transport.peer import PeerError
from axond.errors import DistributedError

Runner = Callable[..., Any]


class Numbering:
    """The group's collective call numbers (the frame header's sequence), shared by the full and the short way."""

    __slots__ = ("seq",)

    def __init__(self) -> None:
        self.seq = 0


class Fresh:
    """The runner of the op the backend ran the full way last, until the group takes it (`take`)."""

    __slots__ = ("g", "size", "numbering", "placement", "signature", "seq", "runner")

    def __init__(self, g: FramedGroup, size: int, numbering: Numbering, placement: Any) -> None:
        self.g = g
        self.size = size
        self.numbering = numbering
        self.placement = placement
        """Its `mailbox` is the group's now (`Placement.mailbox`): a runner whose form runs through another is stale."""
        self.signature: tuple[Any, ...] | None = None
        self.seq = -1
        self.runner: Runner | None = None

    def keep(self, signature: tuple[Any, ...], path: DataPath, c: Call, build: Callable[[Callable[[int], Call]], Any],
             wrap: Callable[[Fresh, Any], Runner]) -> None:
        """After op `signature` ran the full way along `path` as call `c`: its prepared form (`build(make_call)`),
        wrapped as a runner by `wrap`, if `path` keeps one."""
        if path.prepares_through is None:
            return
        g = self.g

        def make_call(seq: int) -> Call:
            return g.call(c.op, c.kind, c.dtype, c.redop, seq, c.aux, c.count)

        small = build(make_call)
        if small is not None:
            runner = wrap(self, small)
            runner.form = small  # type: ignore[attr-defined]  # what it runs, for tests to look at (`.native`)
            self.signature, self.seq, self.runner = signature, self.numbering.seq, runner

    def take(self, signature: tuple[Any, ...]) -> Runner | None:
        """The runner kept for `signature` by the call numbered last, else None (another op ran since, or this one
        kept none)."""
        runner = self.runner
        if runner is None or self.signature != signature or self.seq != self.numbering.seq:
            return None
        self.runner = self.signature = None
        return runner


def flat(fresh: Fresh, small: Any, name: str) -> Runner:
    """The runner of an in-place op on a flat contiguous array, `small.run(flat x, seq)`: all_reduce (x, op) and
    broadcast (x, src). Each runner checks its form is usable and numbers its call inline: small ops are latency."""
    g, placement, numbering, box = fresh.g, fresh.placement, fresh.numbering, small.box

    def run(x: np.ndarray, _: Any) -> Any:
        if not x.flags.c_contiguous or box is not placement.mailbox or g.aborted:
            return MISSED
        numbering.seq += 1
        try:
            small.run(x if x.ndim == 1 else x.reshape(-1), numbering.seq)
        except (DistributedError, PeerError) as e:
            g.failed(name, e)
        return None
    return run


def all_gather(fresh: Fresh, small: Any) -> Runner:
    """The runner of an all_gather (x, out): `small.run(out, seq, x)` into `out` or a fresh array."""
    g, size, placement, numbering, box = fresh.g, fresh.size, fresh.placement, fresh.numbering, small.box

    def run(x: np.ndarray, out: Any) -> Any:
        if box is not placement.mailbox or g.aborted:
            return MISSED
        shape = (size, *x.shape)
        if out is None:
            out = np.empty(shape, x.dtype)
        elif not (type(out) is np.ndarray and out.shape == shape and out.dtype == x.dtype and out.flags.c_contiguous):
            return MISSED  # the full way says what is wrong with it
        numbering.seq += 1
        try:
            small.run(out, numbering.seq, x)  # x into row `rank` too
        except (DistributedError, PeerError) as e:
            g.failed("all_gather", e)
        return out
    return run


def reduce_scatter(fresh: Fresh, small: Any) -> Runner:
    """The runner of a reduce_scatter (x, op, out): `small.run(flat x, flat out, seq)` into `out` or a fresh array."""
    g, size, placement, numbering, box = fresh.g, fresh.size, fresh.placement, fresh.numbering, small.box

    def run(x: np.ndarray, _: Any, out: Any) -> Any:
        if not x.flags.c_contiguous or box is not placement.mailbox or g.aborted or x.ndim == 0 or x.shape[0] % size:
            return MISSED  # (rows the group cannot split: the full way says so)
        shape = (x.shape[0] // size, *x.shape[1:])
        if out is None:
            out = np.empty(shape, x.dtype)
        elif not (type(out) is np.ndarray and out.shape == shape and out.dtype == x.dtype and out.flags.c_contiguous):
            return MISSED
        numbering.seq += 1
        try:
            small.run(x.reshape(-1), out.reshape(-1), numbering.seq)
        except (DistributedError, PeerError) as e:
            g.failed("reduce_scatter", e)
        return out
    return run


def barrier(fresh: Fresh, small: Any) -> Runner:
    """The runner of a barrier: `small.run(seq)`."""
    g, placement, numbering, box = fresh.g, fresh.placement, fresh.numbering, small.box

    def run() -> Any:
        if box is not placement.mailbox or g.aborted:
            return MISSED
        numbering.seq += 1
        try:
            small.run(numbering.seq)
        except (DistributedError, PeerError) as e:
            g.failed("barrier", e)
        return None
    return run
