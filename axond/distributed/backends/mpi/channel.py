"""`Channel`: the communicators of one mpi group and the template every op runs through.

Each op starts MPI nonblocking requests and `wait`s for them: the requests are polled (MPI progresses while they
are tested) until the group's deadline, then `DistributedError` names the op, the group and, where known, the
peer. MPI cannot cancel a collective that started, so a timed-out request is kept (with its buffers) and the group
is aborted: later ops raise. A member that fails sends its reason on a second communicator to every peer, whose
polls raise it (`abort`): a failure reaches every rank that is still running, as on tcp. MPI itself cannot survive a
rank that dies: the launcher (`mpirun`) ends the job.

Every collective is checked before it runs (`start_check`, `MpiOptions.check_calls`): the members compare their calls
(op, dtype, size, root) before MPI's op starts (`confirm`), not beside it, because a peer's op of another call could
write past this call's buffers (Open MPI writes past the end of a receive too short for a message of 4 KiB and more,
in its nonblocking collectives too). Two members (`Channel.duo`) compare without a collective: one message each way
on `Channel.pairs`, tagged with the call's digest (`tag_of`). Their broadcast, all_gather, reduce_scatter and small
all_reduce run as such messages (`plans`), the check folded in: the data carries the tag (the other way, the digest
does), and each member receives the peer's message of the op under its own call's tag, so that a message of another
call is never received into this call's buffer. A message of the peer under another tag, found while this call's has
not come, is the peer's message of another call (`finish`): the members then compare their calls (`mismatch`).
"""

from __future__ import annotations

import hashlib
import os
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from axond.distributed.backends.mpi.library import mpi
from axond.distributed.ops import describe
from axond.errors import DistributedError
from axond.store import Store

ABORT_TAG = 1
"""Tag of an abort message on the control communicator."""
ABORTED, FAILED = 0, 1
"""First byte of an abort message: a peer gave up, or a peer's process failed (the reason is the root cause)."""
REASON_BYTES = 2048
"""Longest abort reason sent (longer ones are cut)."""
CHECK_FIELDS = 5
"""(op, dtype code, count, reduce code, aux) of a collective, compared across the members before it runs."""
QUICK_POLLS = 64
"""Polls of a request before `_poll` reads the clock and looks for a peer's abort, and then between such looks."""
CALL_TAGS = 16
"""First tag of a checked call's messages on `Channel.pairs` (`Channel.tag_of`); the ones below are fixed tags."""


def _world_ranks(store: Store, rank: int, size: int, timeout: float) -> list[int]:
    """Every member's rank in MPI_COMM_WORLD, published in the group's store (the group's members by MPI rank)."""
    me = mpi().COMM_WORLD.Get_rank()
    store.set(f"mpi/world_rank/{rank}", str(me).encode())
    return [me if r == rank else int(store.get(f"mpi/world_rank/{r}", timeout)) for r in range(size)]


def group_comm(store: Store, rank: int, size: int, group_name: str, timeout: float) -> Any:
    """A new communicator of this group's members, in group rank order (MPI_Comm_create_group: members only)."""
    MPI = mpi()
    world = MPI.COMM_WORLD
    if world.Get_size() < size:
        raise DistributedError(
            f"init of the mpi backend on group '{group_name}': MPI_COMM_WORLD has {world.Get_size()} process(es) but "
            f"the group has {size} members; the mpi backend needs every rank started by one MPI launcher "
            f"(mpirun -n {size}, mpiexec, srun --mpi=pmix), not by `axond worker`", op="init", rank=rank)
    members = _world_ranks(store, rank, size, timeout)
    if len(set(members)) != size:
        raise DistributedError(f"init of the mpi backend on group '{group_name}': members share MPI ranks "
                               f"{members}; start one rank per MPI process", op="init", rank=rank)
    if members == list(range(world.Get_size())):
        return world.Dup()
    tag = zlib.crc32(group_name.encode()) & 0x7FFF  # the members create their groups in one order: any tag works
    everyone = world.Get_group()
    chosen = everyone.Incl(members)
    try:
        return world.Create_group(chosen, tag)
    finally:
        chosen.Free()
        everyone.Free()


def check_of(call: tuple[int, int, int, int, int]) -> np.ndarray:
    """What a member sends to check that every member called `call` (op, dtype code, count, reduce code, aux): an
    8-byte digest of it, all_gathered into `Channel.checked` (one round of the members, Open MPI's cheapest here:
    bench/results/2026-12-06-mpi.md). Every call was alike when every member's digest equals this one; when not, the
    members exchange their calls to name the peer that differs (`Channel.mismatch`)."""
    digest = hashlib.blake2b(np.array(call, np.int64).tobytes(), digest_size=8).digest()
    return np.frombuffer(digest, np.int64).copy()


class Check:
    """The call check of one op signature, made once: what the members send (`check_of`) and what they all get; on two
    members, the tag of the op's messages (`Channel.tag_of`)."""

    __slots__ = ("call", "sent", "expected", "start", "tag")

    def __init__(self, channel: Channel, call: tuple[int, int, int, int, int]) -> None:
        self.call = call
        self.sent = check_of(call)
        self.expected = self.sent.tobytes() * channel.size
        self.tag = channel.tag_of(self.sent)
        comm, sent, checked = channel.comm, self.sent, channel.checked
        self.start: Callable[[], Any] = lambda: comm.Iallgather(sent, checked)
        """Start it (a request that `Channel.confirm` completes)."""


class Channel:
    """A group's communicator (`comm`), its control communicator for abort messages, and the waits with deadlines."""

    def __init__(self, comm: Any, rank: int, size: int, group_name: str, timeout: float, spin: int) -> None:
        self.MPI = mpi()
        self.comm = comm
        self.rank, self.size, self.group_name, self.timeout, self.spin = rank, size, group_name, timeout, spin
        self._quick = range(min(spin, QUICK_POLLS))
        """The first polls of a request (`_poll`): none where the host's ranks outnumber its cores (each yields)."""
        self._testall = self.MPI.Request.Testall
        self.control = comm.Dup()
        self.pairs = comm.Dup()
        """The communicator of a two-member group's collectives run as messages, and of its call checks (`finish`)."""
        self.duo = size == 2
        """Two members: the call check is a message each way on `pairs` (`exchange`, `finish`), not an all_gather."""
        self.peer = 1 - rank if self.duo else -1
        self.tag_ub = int(comm.Get_attr(self.MPI.TAG_UB))
        self.token_in = np.zeros(1, np.int64)
        """Where a two-member call check's message without data lands (the peer's digest)."""
        self._pending: tuple[int, int, int, int, int] | None = None
        """The call `start_check` was given, which the op checks (`check_first`, or `take` and its messages)."""
        self._reason = np.zeros(REASON_BYTES, np.uint8)
        self._status = self.MPI.Status()
        self._heard = self.control.Irecv([self._reason, self.MPI.BYTE], self.MPI.ANY_SOURCE, ABORT_TAG)
        self.checked = np.zeros(size, np.int64)
        """Where every call check lands: each member's digest of its call (`check_of`)."""
        self._stuck: list[tuple[Any, Any]] = []
        """Requests that timed out, with the buffers MPI may still write: kept alive until the process ends."""
        self.aborted: str | None = None
        self.explain_peer: Callable[[int], str] | None = None
        self.explain_peers: Callable[[str], str] | None = None

    def where(self, op: str) -> str:
        return f"{op} on group '{self.group_name}' (rank {self.rank} of {self.size})"

    def enter(self, op: str) -> None:
        """Raise if the group was aborted (an earlier failure here or at a peer)."""
        if self.aborted is not None:
            raise DistributedError(f"{self.where(op)}: the group was aborted by an earlier failure ({self.aborted}); "
                                   "destroy it and create a new group", op=op, group=self.group_name, rank=self.rank)
        self._poll_abort(op)

    def fail(self, op: str, peer: int | None, what: str, timed_out: bool = False) -> DistributedError:
        """The error of `op` about `peer`; the group is aborted with it, so that every member raises too."""
        error = DistributedError(f"{self.where(op)}: {what}", op=op, group=self.group_name, rank=self.rank, peer=peer,
                                 timed_out=timed_out)
        self.abort(str(error))
        return error

    def _poll_abort(self, op: str) -> None:
        if self.aborted is None and self._heard.Test(self._status):
            peer = self._status.Get_source()
            count = self._status.Get_count(self.MPI.BYTE)
            failed = count > 0 and self._reason[0] == FAILED
            reason = bytes(self._reason[1:count]).decode(errors="replace")
            self.aborted = f"peer rank {peer} aborted the group: {reason}"
            raise DistributedError(f"{self.where(op)}: peer rank {peer} aborted the group: {reason}", op=op,
                                   group=self.group_name, rank=self.rank, peer=peer,
                                   root_cause=reason if failed else None)

    def wait(self, requests: Sequence[Any], op: str, peer: int | None = None, keep: Any = None,
             status: Any = None) -> None:
        """Poll `requests` until all completed; at the group's deadline, or when a peer aborts, raise and abort.

        A call check `start_check` was given is completed first (`check_first`): the op's callers start its requests
        only after it (`MpiBackend._run`), so this is the barrier's. `keep`: the buffers of the requests (kept alive
        past a failure, as MPI may still write them); `status`: filled by the single request of a receive."""
        self.check_first(op)
        if not requests:
            return
        testall = self.MPI.Request.Testall
        test = (lambda: requests[0].Test(status)) if len(requests) == 1 else (lambda: testall(requests))
        self._poll(test, op, peer, requests, keep, None)

    def settle(self, test: Callable[[], bool], requests: Sequence[Any], op: str, keep: Any) -> None:
        """`wait` for a prepared op (`plans`), whose call check `confirm` completed: its `requests`, completed when
        `test` is true."""
        self._poll(test, op, None, requests, keep, None)

    def check_first(self, op: str) -> None:
        """Complete the call check `start_check` was given (if any) before the op starts its own requests."""
        if self._pending is not None:
            checked = self.take()
            assert checked is not None
            self.confirm(checked, op)

    def confirm(self, checked: Check, op: str) -> None:
        """Check that every member called `checked.call` before the op starts: a mismatch raises on every member,
        naming the peer. It comes first, not beside the op, because an op of another call could write past this
        call's buffers (Open MPI writes past the end of a receive too short for a message of 4 KiB and more,
        libnbc's collectives too). Two members: the digest goes each way as a message tagged with it (`finish`);
        more: an all_gather of the digests (`Check.start`)."""
        if self.duo:
            self.finish(self.exchange(checked.sent, self.token_in, checked.tag), op, checked.sent, checked)
            return
        check = checked.start()
        self._poll(check.Test, op, None, [check], checked.sent, None)
        if self.checked.tobytes() != checked.expected:
            self.mismatch(op, checked.call, [], None)

    def _poll(self, test: Callable[[], bool], op: str, peer: int | None, requests: Sequence[Any], keep: Any,
              deadline: float | None, watch: Callable[[], None] | None = None) -> float | None:
        """Call `test` until it is true (returns the deadline it kept, or None: at once); raise at the deadline or on a
        peer's abort, keeping `requests` and `keep` alive. `watch`: called with each look for an abort (it raises
        what it finds)."""
        for _ in self._quick:  # most ops end within these: no clock, no look for an abort
            if test():
                return deadline
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout
        polls = len(self._quick)
        while not test():
            polls += 1
            if polls > self.spin:
                os.sched_yield()
            if polls & 63 == 0:
                try:
                    self._poll_abort(op)
                    if watch is not None:
                        watch()
                except DistributedError:
                    self._stuck.append((list(requests), keep))
                    raise
                if time.monotonic() > deadline:
                    self._stuck.append((list(requests), keep))
                    raise self.fail(op, peer, self._late(op, peer), timed_out=True)
        return deadline

    def _late(self, op: str, peer: int | None) -> str:
        if peer is not None:
            text = f"timed out after {self.timeout:g} s waiting for peer rank {peer}"
            if self.explain_peer is not None:
                text += f"; {self.explain_peer(peer)}"
            return text
        text = f"timed out after {self.timeout:g} s: not every member reached it"
        if self.explain_peers is not None:
            text += f"; {self.explain_peers(op)}"
        return text + " (MPI cannot abort a started collective: the group is aborted)"

    def tag_of(self, sent: np.ndarray) -> int:
        """The tag of a two-member op's messages whose call check sends `sent` (its digest): one of
        CALL_TAGS..MPI_TAG_UB, so that two different calls' messages match with a chance of 1 in MPI_TAG_UB (Open MPI:
        2**31 - 1)."""
        return CALL_TAGS + int(sent.view(np.uint64)[0]) % (self.tag_ub - CALL_TAGS)

    def take(self) -> Check | None:
        """The `Check` of the call `start_check` was given (None: unchecked), for the op to run."""
        call, self._pending = self._pending, None
        return Check(self, call) if call is not None else None

    def exchange(self, send: Any, recv: Any, tag: int) -> list[Any]:
        """Two members: receive the peer's message of this op into `recv` and send `send`, both tagged `tag`; either
        may be None (nothing that way). The receive comes first in the list."""
        requests = [] if recv is None else [self.pairs.Irecv(recv, self.peer, tag)]
        if send is not None:
            requests.append(self.pairs.Isend(send, self.peer, tag))
        return requests

    def finish(self, requests: Sequence[Any], op: str, keep: Any, checked: Check | None,
               peer: int | None = None) -> None:
        """Two members: wait for `requests` to the group's deadline. `checked`: the first is the receive of the peer's
        message of this op (`exchange`, tagged `checked.tag`); a message of the peer under another tag while it has
        not come is of another call (`mismatch`, on both members: each finds the other's)."""
        testall = self._testall
        for _ in self._quick:  # as `_poll` does first: most ops end here, and need no `watch`
            if testall(requests):
                return
        if len(requests) == 1:
            test = requests[0].Test
        else:
            test = lambda: testall(requests)  # noqa: E731 - polled
        watch = None
        if checked is not None:
            first, iprobe, source, anything = requests[0], self.pairs.Iprobe, self.peer, self.MPI.ANY_TAG

            def watch() -> None:  # the peer's messages come in order: one after this op's means this op's came
                if iprobe(source, anything) and not first.Test():
                    self.mismatch(op, checked.call, requests, keep)
        self._poll(test, op, peer, requests, keep, None, watch)

    def start_check(self, call: tuple[int, int, int, int, int]) -> None:
        """Check that every member called `call` (op, dtype code, count, reduce code, aux) before the op's requests
        start (`check_first`), or with the op's own messages where the op is a two-member exchange tagged with the
        call (`take`, `plans`)."""
        self._pending = call

    def mismatch(self, op: str, call: tuple[int, int, int, int, int], requests: Sequence[Any], keep: Any) -> None:
        """Raise on every member, naming the first peer that differs: the check found the calls unlike (the op's
        `requests`, started with a mismatched call, are kept: MPI cannot cancel them)."""
        self._stuck.append((list(requests), keep))
        mine = np.array(call, np.int64)
        calls = np.empty((self.size, CHECK_FIELDS), np.int64)
        self._poll(self.control.Iallgather(mine, calls).Test, op, None, [], (mine, calls), None)
        differ = [p for p in range(self.size) if tuple(int(v) for v in calls[p]) != tuple(call)]
        peer = differ[0] if differ else (self.rank + 1) % self.size
        theirs = [int(v) for v in calls[peer]]
        raise self.fail(op, peer, f"peer rank {peer} called {describe(*theirs)} but this rank called {describe(*call)}")

    def abort(self, reason: str, failed: bool = False) -> None:
        """Tell every peer (their polls raise `reason`; `failed`: it is the root cause, "rank R failed: ...") and
        refuse later ops; MPI itself is left running."""
        if self.aborted is not None:
            return
        self.aborted = reason
        data = np.frombuffer(bytes([FAILED if failed else ABORTED]) + reason.encode()[:REASON_BYTES - 1],
                             np.uint8).copy()
        sends = [self.control.Isend([data, self.MPI.BYTE], p, ABORT_TAG) for p in range(self.size) if p != self.rank]
        self._stuck.append((sends, data))

    def close(self) -> None:
        """Free the communicators (unless a request is stuck on them: then they stay until the process ends)."""
        clean = self.aborted is None and not self._stuck
        if self.aborted is None:
            self.aborted = "the group was destroyed"
        if not clean:
            return
        try:
            self._heard.Cancel()
            self._heard.Wait()
            self.pairs.Free()
            self.control.Free()
            self.comm.Free()
        except self.MPI.Exception:
            pass
