"""Where the members of a mock group (threads of one process) meet: one slot per collective, one queue per pair.

Every member of a mock group holds the same `Hub`. A collective meets at the slot of its sequence number:
each member posts what it called and a copy of its input, and all leave once every member has posted.
Sends are queued per (sender, receiver) and received in order. Every wait is bounded by the caller's
deadline; a member that gives up (`abort`) or leaves (`leave`) wakes the others, which raise instead of
waiting. The hub also tracks what each member is blocked in, so that a timeout says what the silent peer does.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from axond.errors import DistributedError, StoreTimeout, rank_list
from axond.distributed.ops import describe
from axond.store import Store

Call = tuple[int, int, int, int, int]
"""What a member called, as tcp's frame header carries it: (op, dtype code, reduce code, aux, element count)."""


def call_text(call: Call) -> str:
    """Human form of a call, worded as tcp's mismatch errors ("all_reduce with SUM (float32, 4 elements)")."""
    op, dtype, redop, aux, count = call
    return describe(op, dtype, count, redop, aux)


class HubError(Exception):
    """A wait in the hub failed: `what` went wrong with `peer` (the backend turns it into `DistributedError`).

    `idle`: the peer was in no op of this group (a timeout): what it does elsewhere may explain it."""

    def __init__(self, what: str, peer: int | None, idle: bool = False) -> None:
        super().__init__(what)
        self.what = what
        self.peer = peer
        self.idle = idle


@dataclass(frozen=True)
class Post:
    """One member's part of an op: what it called and its data (a private copy nobody writes to)."""

    call: Call
    data: Any = None


class _Slot:
    def __init__(self, size: int) -> None:
        self.posts: list[Post | None] = [None] * size
        self.arrived = 0
        self.expired: list[int] | None = None
        """The members still missing when the first waiter's deadline passed (then every waiter raises)."""


class Hub:
    """The shared state of one mock group, guarded by one condition variable."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._slots: dict[int, _Slot] = {}
        self._queues: dict[tuple[int, int], deque[Post]] = {}
        self._doing = ["has not called an op on this group yet"] * size
        self._busy = [False] * size
        """Whether each member is in an op of this group now."""
        self._events = itertools.count()
        """Orders aborts and departures: a waiter reports the first that concerns it."""
        self._aborted: tuple[int, str, int] | None = None
        """(member that gave up first, its reason, event number)."""
        self._left: dict[int, int] = {}
        """Members that closed their backend -> event number."""

    def meet(self, seq: int, rank: int, post: Post, timeout: float, where: str) -> list[Post]:
        """Post `post` as `rank`'s part of collective number `seq`; return every member's part, in rank order.

        `where` ("op on group (rank r of n)") prefixes the reason others see if this member times out."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._check([])
            self._doing[rank] = f"is in {call_text(post.call)} (operation #{seq} of this group)"
            self._busy[rank] = True
            slot = self._slots.get(seq)
            if slot is None:
                slot = self._slots[seq] = _Slot(self.size)
            slot.posts[rank] = post
            slot.arrived += 1
            if slot.arrived == self.size:
                del self._slots[seq]
                self._cond.notify_all()
            while slot.arrived < self.size:
                missing = [p for p, got in enumerate(slot.posts) if got is None]
                if slot.expired is None and time.monotonic() >= deadline:
                    slot.expired = missing
                    self._expire(rank, where, self._timed_out(timeout, missing))
                if slot.expired is not None:
                    raise self._timed_out(timeout, slot.expired)
                self._check(missing)
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            self._doing[rank] = f"is between ops on this group (its last: {call_text(post.call)}, operation #{seq})"
            self._busy[rank] = False
        return [p for p in slot.posts if p is not None]

    def send(self, src: int, dst: int, post: Post) -> None:
        """Queue `post` for `dst` (buffered: never waits for the receive)."""
        with self._cond:
            self._check([dst])
            self._queues.setdefault((src, dst), deque()).append(post)
            self._cond.notify_all()

    def recv(self, src: int, dst: int, tag: int, timeout: float, where: str) -> Post:
        """The oldest message of `tag` from `src` to `dst` (sends and receives match per tag, as on tcp and gloo),
        waiting up to `timeout` seconds for it (`where`: as for `meet`)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._doing[dst] = f"is in recv from rank {src} (tag={tag})"
            self._busy[dst] = True
            queue = self._queues.setdefault((src, dst), deque())
            while not any(post.call[3] == tag for post in queue):
                self._check([src])
                if time.monotonic() >= deadline:
                    error = self._timed_out(timeout, [src])
                    if queue:  # sends of other tags wait: say so
                        sent = ", ".join(sorted({f"tag={post.call[3]}" for post in queue}))
                        error = HubError(f"{error.what}; it sent {sent} instead of tag={tag} (not received: sends and "
                                         "receives match per tag)", src)
                    self._expire(dst, where, error)
                    raise error
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            self._doing[dst] = f"is between ops on this group (its last: recv from rank {src}, tag={tag})"
            self._busy[dst] = False
            for i, post in enumerate(queue):
                if post.call[3] == tag:
                    del queue[i]
                    return post
            raise AssertionError("unreachable: a post of the tag was found above")

    def _check(self, waiting_for: list[int]) -> None:
        """Raise if a member gave up, or one of `waiting_for` left the group: whichever happened first (the cause),
        so that every waiter says the same."""
        left = [(at, p) for p, at in self._left.items() if p in waiting_for]
        first_left = min(left) if left else None
        aborted = self._aborted
        if aborted is not None and (first_left is None or aborted[2] < first_left[0]):
            raise HubError(f"peer rank {aborted[0]} gave up: {aborted[1]}", aborted[0])
        if first_left is not None:
            peer = first_left[1]
            raise HubError(f"peer rank {peer} left the group (it destroyed or closed it; did it fail?)", peer)

    def _timed_out(self, timeout: float, missing: list[int]) -> HubError:
        peer = missing[0]
        also = f" (and {len(missing) - 1} more: {rank_list(missing[1:])})" if len(missing) > 1 else ""
        return HubError(f"timed out after {timeout:.1f} s waiting for peer {peer}{also}; "
                        f"peer rank {peer} {self._doing[peer]}", peer, idle=not self._busy[peer])

    def _expire(self, rank: int, where: str, error: HubError) -> None:
        """`rank` timed out: abort in the same step, so that a member arriving late raises too instead of passing."""
        if self._aborted is None:
            self._aborted = (rank, f"{where}: {error.what}", next(self._events))
        self._cond.notify_all()

    def abort(self, rank: int, reason: str) -> None:
        """Member `rank` gives up: every member waiting, or entering an op later, raises quoting `reason`."""
        with self._cond:
            if self._aborted is None:
                self._aborted = (rank, reason, next(self._events))
            self._cond.notify_all()

    def leave(self, rank: int) -> None:
        """Member `rank` closed its backend: members waiting for it raise (what it sent stays receivable)."""
        with self._cond:
            self._left.setdefault(rank, next(self._events))
            self._doing[rank] = "left the group"
            self._cond.notify_all()


_HUBS: weakref.WeakValueDictionary[str, Hub] = weakref.WeakValueDictionary()
"""Live hubs of this process by token; a hub lives as long as one member's backend holds it."""
_TOKENS = itertools.count(1)


def join(store: Store, rank: int, size: int, name: str, timeout: float) -> Hub:
    """The hub of group `name`: rank 0 makes it and publishes its token in the group's store; the others look it up.

    Each group formed on the same store (and name) gets a fresh hub: members count their arrivals in the store.
    """
    where = f"init on group '{name}' (rank {rank} of {size})"
    generation = (store.add("mock/joins", 1) - 1) // size
    key = f"mock/hub/{generation}"
    if rank == 0:
        hub = Hub(name, size)
        token = f"{hub.pid}:{next(_TOKENS)}"
        _HUBS[token] = hub
        store.set(key, token.encode())
        return hub
    try:
        token = store.get(key, timeout).decode()
    except StoreTimeout:
        raise DistributedError(f"{where}: rank 0 did not join the mock group within {timeout:.1f} s",
                               op="init", group=name, rank=rank, peer=0) from None
    found = _HUBS.get(token)
    if found is None:
        pid = int(token.split(":")[0])
        why = (f"rank 0 runs in process {pid}, this rank in {os.getpid()}: backend 'mock' joins threads of one "
               "process only; use backend='tcp' for ranks in separate processes" if pid != os.getpid()
               else "rank 0 already closed its member of the group")
        raise DistributedError(f"{where}: {why}", op="init", group=name, rank=rank, peer=0)
    if found.size != size:
        raise DistributedError(f"{where}: rank 0 formed the group with {found.size} members, but this rank was "
                               f"given world size {size}", op="init", group=name, rank=rank, peer=0)
    return found
