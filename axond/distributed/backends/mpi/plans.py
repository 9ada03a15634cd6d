"""The mpi backend's prepared collectives: runners for the group's fast path (`axond.distributed.fast_path`).

After a blocking all_reduce, broadcast, all_gather, reduce_scatter or barrier ran the full way (its arguments
checked), the backend keeps a runner for the op's signature (`MpiBackend.prepared`). A runner is made once per
signature and holds what the full way works out on every call: the MPI op, the dtype MPI moves, the call check's
message (`channel.Check`). It runs the same MPI calls in the same order as the full way, so that the members may take
either way for the same call, and still checks every call across the members (unless `MpiOptions.check_calls` is
off: `Channel.confirm` before MPI's own op, or the tags of a two-member op's messages) and waits to the group's
deadline (`Channel.settle`, `Channel.finish`). It returns `MISSED`, having done nothing, for what it does
not take: not a C-contiguous NumPy array, an `out=` it cannot fill; the full way then checks and raises. Like the full
way, it first raises if the group was aborted, here or by a peer (`Channel.enter`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from axond.distributed.backends.base import MISSED
from axond.distributed.backends.host_copy import stream_copy
from axond.distributed.backends.mpi.channel import CALL_TAGS, Channel, Check
from axond.distributed.backends.mpi.library import wire_view
from axond.distributed.numerics.reducers import finish_average

Runner = Callable[..., Any]

GATHER_TAG, BROADCAST_TAG, SCATTER_TAG, REDUCE_TAG = 2, 3, 4, 5
"""The kinds of two-member messages, for their tags when calls are not checked (`unchecked_tag`; else `Check.tag`)."""


def unchecked_tag(ch: Channel, kind: int, nbytes: int) -> int:
    """The tag of a two-member op's messages of `nbytes` when calls are not checked: from the op's kind and the
    length, so that a peer's message of another length is not received into this op's buffer (the members wait
    instead, to the group's deadline)."""
    return CALL_TAGS + (kind * 0x9E3779B97F4A7C15 + nbytes) % (ch.tag_ub - CALL_TAGS)


STREAM_BYTES = 32 << 20
"""From this size a two-member all_gather copies the member's own block with non-temporal stores
(`host_copy.stream_copy`): a block past the last-level cache gains nothing from being written through it, and its
copy then leaves the memory bandwidth to the peer's block arriving. Measured at 64 MiB: 0.92-1.07x raw mpi4py's time,
against 0.86x with NumPy's copy; at 16 MiB the cached copy is faster (0.92x against 0.75x streamed)
(bench/results/2026-12-07-mpi-speed-quiet.md)."""


def duo_all_gather(ch: Channel, checked: Check | None, send: Any, recv: Any) -> None:
    """A two-member all_gather of the flat `send` into the flat `recv` (the members' blocks in rank order): one
    message each way on `Channel.pairs`, the call check with it (`Channel.finish`). Open MPI's nonblocking all_gather
    (libnbc) takes 1.3-2.4x as long at 64 KiB-1 MiB (bench/results/2026-12-06-mpi.md). The full way and the runners
    both run it: the members may take either."""
    n, me, peer = send.shape[0], ch.rank, ch.peer
    requests = ch.exchange(send, recv[peer * n : (peer + 1) * n], checked.tag if checked is not None
                           else unchecked_tag(ch, GATHER_TAG, send.nbytes))
    if send.nbytes >= STREAM_BYTES:  # while the peer's block comes; a large one streamed past the cache
        stream_copy(recv[me * n : (me + 1) * n], send)
    else:
        recv[me * n : (me + 1) * n] = send
    ch.finish(requests, "all_gather", (send, recv), checked)


def duo_broadcast(ch: Channel, checked: Check | None, buf: Any, src: int) -> None:
    """A two-member broadcast of the flat `buf` from `src`: one message, and the receiver's call check back
    (`Channel.finish`)."""
    if ch.rank == src:
        tag = checked.tag if checked is not None else unchecked_tag(ch, BROADCAST_TAG, buf.nbytes)
        requests = ch.exchange(buf, ch.token_in if checked is not None else None, tag)
        ch.finish(requests, "broadcast", buf, checked)
    else:
        requests = ch.exchange(checked.sent if checked is not None else None, buf,
                               checked.tag if checked is not None else unchecked_tag(ch, BROADCAST_TAG, buf.nbytes))
        ch.finish(requests, "broadcast", buf, checked)


def duo_reduce_scatter(ch: Channel, checked: Check | None, send: Any, scratch: Any) -> None:
    """A two-member reduce_scatter's messages: send the peer its block of the flat `send`, receive this member's block
    of the peer into `scratch` (flat, one block); `scatter_reduce` then reduces. MPI_Ireduce_scatter_block took
    1.8-3x as long at 64 KiB-4 MiB (bench/results/2026-12-06-mpi.md)."""
    n, peer = scratch.shape[0], ch.peer
    requests = ch.exchange(send[peer * n : (peer + 1) * n], scratch,
                           checked.tag if checked is not None else unchecked_tag(ch, SCATTER_TAG, scratch.nbytes))
    ch.finish(requests, "reduce_scatter", (send, scratch), checked)


REDUCE_BYTES = 2048
"""Largest two-member all_reduce whose members send their array itself: below Open MPI's shared-memory eager limit (4
KiB with its header), where the message is copied out at once."""
COPY_REDUCE_BYTES = 256 << 10
"""Largest two-member all_reduce run as one message each way, each member reducing both with NumPy; larger ones run
Open MPI's nonblocking ring. From 4 KiB Open MPI moves a message with a single copy that the receiver makes out of the
sender's memory, and a reduction then written into lines the peer's core has just read is slow, so there a member
sends a copy of its array (`duo_all_reduce`'s `copy`). At 64 KiB: 16.8 us, against 46.4 us sending the array itself,
21.3 us for MPI_Allreduce and 23.7 us for the call check and the ring; at 512 KiB the ring is faster (86.0 us against
89.1 us): bench/results/2026-12-07-mpi-bound-ranks.md."""


def duo_reduces(ch: Channel, nbytes: int) -> bool:
    """Whether an all_reduce of `nbytes` runs as messages (`duo_all_reduce`)."""
    return ch.duo and nbytes <= COPY_REDUCE_BYTES


def duo_copies(nbytes: int) -> bool:
    """Whether a two-member all_reduce of `nbytes` run as messages sends a copy of its array (`COPY_REDUCE_BYTES`)."""
    return nbytes > REDUCE_BYTES


def duo_all_reduce(ch: Channel, checked: Check | None, ufunc: Any, work: Any, scratch: Any, wire: bool,
                   copy: Any = None) -> None:
    """A two-member all_reduce of the flat `work` in place: send it whole (or `copy`, flat and as long, filled with it
    first: `duo_copies`), receive the peer's into `scratch` (flat, as long), then reduce both with `ufunc`, rank 0's
    operand first on both members (the same result on both). The call check is the messages' tag
    (`Channel.finish`). `wire`: move them as `wire_view` (a dtype MPI has)."""
    sent = work
    if copy is not None:
        copy[...] = work
        sent = copy
    requests = ch.exchange(wire_view(sent) if wire else sent, wire_view(scratch) if wire else scratch,
                           checked.tag if checked is not None else unchecked_tag(ch, REDUCE_TAG, work.nbytes))
    ch.finish(requests, "all_reduce", (sent, scratch), checked)
    if ch.rank == 0:
        ufunc(work, scratch, out=work)
    else:
        ufunc(scratch, work, out=work)


def then(ch: Channel, checked: Check | None, start: Callable[[], Any], op: str, keep: Any) -> None:
    """Run MPI's own op: confirm the call first (`Channel.confirm`), then `start` its request and wait for it."""
    if checked is not None:
        ch.confirm(checked, op)
    request = start()
    ch.settle(request.Test, (request,), op, keep)


def scatter_reduce(ufunc: Any, rank: int, work: Any, scratch: Any, result: Any) -> None:
    """This member's block of a two-member reduce_scatter: its own block of the flat `work` reduced with the peer's
    (`scratch`) by `ufunc` into the flat `result`, rank 0's operand first on both members."""
    n = scratch.shape[0]
    mine = work[rank * n : (rank + 1) * n]
    if rank == 0:
        ufunc(mine, scratch, out=result)
    else:
        ufunc(scratch, mine, out=result)


def _failed(ch: Channel, name: str, e: Any) -> Exception:
    return ch.fail(name, None, f"MPI error: {e.Get_error_string()}")


def _ready(x: Any, ch: Channel, name: str) -> bool:
    """Whether a runner takes `x`; raises, as the full way, if the group was aborted here or by a peer (whose
    timed-out requests would otherwise meet this call's)."""
    if type(x) is not np.ndarray or not x.flags.c_contiguous:
        return False
    ch.enter(name)
    return True


def all_reduce(ch: Channel, checked: Check | None, mpi_op: Any, wire: np.dtype | None, average: bool, ufunc: Any,
               dtype: np.dtype, count: int) -> Runner:
    """The runner of an all_reduce (in place) with MPI op `mpi_op` on arrays moved as `wire` (None: as they are), or
    between two members (`duo_reduces`) of `count` elements of `dtype` as messages and `ufunc`."""
    comm, MPI, size = ch.comm, ch.MPI, ch.size
    in_place, error = MPI.IN_PLACE, MPI.Exception
    duo = duo_reduces(ch, count * dtype.itemsize)
    scratch = np.empty(count, dtype) if duo else None
    """The peer's values of a two-member all_reduce, made once."""
    copy = np.empty(count, dtype) if duo and duo_copies(count * dtype.itemsize) else None
    """What a two-member all_reduce sends (`duo_copies`), made once."""

    def run(x: Any, op: Any) -> Any:
        if not _ready(x, ch, "all_reduce"):
            return MISSED
        try:
            if scratch is not None:
                duo_all_reduce(ch, checked, ufunc, x.reshape(-1), scratch, wire is not None, copy)
            else:
                buf = x if wire is None else x.view(wire)
                then(ch, checked, lambda: comm.Iallreduce(in_place, buf, mpi_op), "all_reduce", buf)
        except error as e:
            raise _failed(ch, "all_reduce", e) from e
        if average:
            finish_average(x, size)
        return None
    return run


def broadcast(ch: Channel, checked: Check | None, src: int, wire: np.dtype | None) -> Runner:
    """The runner of a broadcast from `src`."""
    error, duo = ch.MPI.Exception, ch.duo

    def run(x: Any, root: Any) -> Any:
        if not _ready(x, ch, "broadcast"):
            return MISSED
        buf = x if wire is None else x.view(wire)
        try:
            if duo:
                duo_broadcast(ch, checked, buf, src)
            else:
                then(ch, checked, lambda: ch.comm.Ibcast(buf, src), "broadcast", buf)
        except error as e:
            raise _failed(ch, "broadcast", e) from e
        return None
    return run


def all_gather(ch: Channel, checked: Check | None, wire: np.dtype | None) -> Runner:
    """The runner of an all_gather into a new array or the caller's `out=`."""
    size, error, duo = ch.size, ch.MPI.Exception, ch.duo

    def run(x: Any, out: Any = None) -> Any:
        if not _ready(x, ch, "all_gather"):
            return MISSED
        shape = (size, *x.shape)
        if out is None:
            out = np.empty(shape, x.dtype)
        elif type(out) is not np.ndarray or out.shape != shape or out.dtype != x.dtype or not out.flags.c_contiguous:
            return MISSED
        send, recv = x.reshape(-1), out.reshape(-1)
        if wire is not None:
            send, recv = send.view(wire), recv.view(wire)
        try:
            if duo:
                duo_all_gather(ch, checked, send, recv)
            else:
                then(ch, checked, lambda: ch.comm.Iallgather(send, recv), "all_gather", (send, recv))
        except error as e:
            raise _failed(ch, "all_gather", e) from e
        return out
    return run


def reduce_scatter(ch: Channel, checked: Check | None, mpi_op: Any, wire: np.dtype | None, average: bool,
                   ufunc: Any, dtype: np.dtype, count: int) -> Runner:
    """The runner of a reduce_scatter (MPI_Ireduce_scatter_block, or messages and `ufunc` between two members) of
    `count` elements of `dtype`, into a new array or the caller's `out=`."""
    comm, size, rank, error = ch.comm, ch.size, ch.rank, ch.MPI.Exception
    scratch = np.empty(count // 2, dtype) if ch.duo else None
    """The peer's block of a two-member reduce_scatter, made once."""

    def run(x: Any, op: Any, out: Any = None) -> Any:
        if type(x) is not np.ndarray or x.ndim == 0 or x.shape[0] % size or not _ready(x, ch, "reduce_scatter"):
            return MISSED
        shape = (x.shape[0] // size, *x.shape[1:])
        if out is None:
            out = np.empty(shape, x.dtype)
        elif type(out) is not np.ndarray or out.shape != shape or out.dtype != x.dtype or not out.flags.c_contiguous:
            return MISSED
        try:
            if scratch is not None:
                flat = x.reshape(-1)
                duo_reduce_scatter(ch, checked, flat if wire is None else flat.view(wire),
                                   scratch if wire is None else scratch.view(wire))
                scatter_reduce(ufunc, rank, flat, scratch, out.reshape(-1))
            else:
                send, recv = (x, out) if wire is None else (x.view(wire), out.view(wire))
                then(ch, checked, lambda: comm.Ireduce_scatter_block(send, recv, mpi_op), "reduce_scatter",
                     (send, recv))
        except error as e:
            raise _failed(ch, "reduce_scatter", e) from e
        if average:
            finish_average(out, size)
        return out
    return run


def barrier(ch: Channel, checked: Check | None) -> Runner:
    """The runner of a barrier: the call check where there is one (it meets every member), else MPI_Ibarrier."""
    comm, error = ch.comm, ch.MPI.Exception

    def run() -> Any:
        ch.enter("barrier")
        try:
            if checked is not None:
                ch.confirm(checked, "barrier")
            else:
                request = comm.Ibarrier()
                ch.settle(request.Test, (request,), "barrier", None)
        except error as e:
            raise _failed(ch, "barrier", e) from e
        return None
    return run
