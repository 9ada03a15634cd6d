"""Buddy copies: each rank's ZeRO-1 shards (parameters and optimizer state) kept in a peer's memory, tagged with the
committed step, so that the survivors of a lost rank rebuild its shards without reading storage.

After every `every`-th committed step (and at the start, and after each re-formation) rank r sends its block of virtual
shards to its buddy: the next rank on another node (the next rank when every rank shares one node). The send and the
buddy's receive run on the group's communication thread while the next step computes; `settle()`, before the next step's
gradient gather, waits for them. A buddy receives into one of two slots per source (double buffering): the slot holding
the newest complete copy is never written, and a slot becomes usable only when its receive completed and its tag (the
step in the copy's header) is the one expected. The buddy also keeps, for its sources' shards, the averaged gradient of
each step since (the last `every` + 1), so that a copy older than the step the survivors agree on is advanced to it
exactly as its owner did (`Holding.usable`); the optimizer step writes those spans of the gradient straight into the
buffers kept (`before_step`, `VirtualZero.divert`), so keeping them copies nothing. A copy tagged with a step newer than
the agreed one (a step not committed everywhere) is never used.

Under worker daemons (`relayed`) the copy goes to the buddy node's worker instead, sent by this rank's own worker from
the copy in its memory (`axond.train.relay`): `post()` asks for the send, `settle()` waits for the worker's answer at
the same point, and after a re-formation the copies this rank's node holds are offered with the gradients kept here
(`recovery_holdings`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from axond.distributed.boundary import moved_on
from axond.distributed.membership import surfaced
from axond.distributed.process_group import ProcessGroup
from axond.errors import DistributedError
from axond.parallel.zero.virtual import VirtualZero, carried

TAG = 0x5BD0
"""The point-to-point tag of a copy's rows (its scalars use TAG + 1)."""


def buddies(nodes: list[int]) -> list[int]:
    """For each rank (with its node in `nodes`): the next rank, cyclically, on another node; the next rank when there
    is no other node; -1 for a world of one."""
    world = len(nodes)
    out = []
    for r in range(world):
        others = [(r + k) % world for k in range(1, world) if nodes[(r + k) % world] != nodes[r]]
        out.append(others[0] if others else ((r + 1) % world if world > 1 else -1))
    return out


@dataclass
class Slot:
    rows: np.ndarray
    scalars: np.ndarray
    tag: int | None = None
    """The committed step of a complete copy; None while empty or receiving (never read then)."""


@dataclass
class Holding:
    """The copies of one source rank's block of shards on this rank, and the gradients of its shards since."""

    source: int
    shards: range
    slots: list[Slot]
    receiving: int | None = None
    """The slot a receive is in flight into."""
    expected: int = -1
    grads: dict[int, np.ndarray] = field(default_factory=dict)
    """Global step -> the averaged gradient of the source's shards at that step (its elements of `VirtualZero.grad`)."""
    spare: list[np.ndarray] = field(default_factory=list)
    """Buffers for `grads`, allocated (and touched) when the holding is made, not during a step."""

    def begin(self, tag: int) -> Slot:
        """A receive of the copy tagged `tag` starts: into the slot not holding the newest complete copy."""
        newest = self.newest()
        index = 1 if newest is not None and newest is self.slots[0] else 0
        self.slots[index].tag = None
        self.receiving, self.expected = index, tag
        return self.slots[index]

    def received(self) -> None:
        """The receive completed: the copy is usable if its header says the tag expected."""
        if self.receiving is None:
            return
        slot = self.slots[self.receiving]
        self.receiving = None
        got = {int(t) for t in slot.scalars[:, 0]}
        if got != {self.expected}:
            raise DistributedError(f"buddy copy from rank {self.source} carries step(s) {sorted(got)}, expected "
                                   f"{self.expected}: the ranks disagree on the committed step", op="buddy_copy")
        slot.tag = self.expected

    def cut(self) -> None:
        """The receive in flight will never complete (the group re-formed): its slot stays unusable."""
        self.receiving = None

    def newest(self) -> Slot | None:
        done = [s for s in self.slots if s.tag is not None]
        return max(done, key=lambda s: s.tag or 0) if done else None

    def next_buffer(self, size: int, dtype: np.dtype) -> np.ndarray:
        """A buffer for the next step's gradient of the source's shards (`VirtualZero.divert`): a spare one; the
        holding keeps at most `limit` gradients (`keep`) of `limit + 1` buffers, so one is spare at every step."""
        buf = self.spare.pop() if self.spare else None
        return buf if buf is not None and buf.shape == (size,) and buf.dtype == dtype else np.empty(size, dtype)

    def keep(self, step: int, buf: np.ndarray, limit: int) -> None:
        """Keep `buf`, the gradient of `step` for the source's shards; beyond `limit`, the oldest goes back spare."""
        self.grads[step] = buf
        while len(self.grads) > limit:
            self.spare.append(self.grads.pop(min(self.grads)))

    def usable(self, agreed: int) -> tuple[Slot, list[np.ndarray]] | None:
        """The newest complete copy tagged at or before the agreed step, and the gradients that advance it to that
        step; None when there is none (or a gradient in between is missing): the copy cannot give the agreed state."""
        done = sorted((s for s in self.slots if s.tag is not None and s.tag <= agreed), key=lambda s: -(s.tag or 0))
        for slot in done:
            tag = slot.tag or 0
            steps = range(tag + 1, agreed + 1)
            if all(s in self.grads for s in steps):
                return slot, [self.grads[s] for s in steps]
        return None


def _buffer(pool: dict[int, list[np.ndarray]], size: int, dtype: np.dtype) -> np.ndarray:
    """A gradient buffer of `size`: one of the old layout's, or a new one with every page written now (a fresh
    allocation's pages are mapped at their first write: 10 ms per 5 MiB on a VM, never to be paid inside a step)."""
    free = pool.get(size)
    if free and free[-1].dtype == dtype:
        return free.pop()
    buf = np.empty(size, dtype)
    buf.fill(0)
    return buf


class Pending(Protocol):
    """A relayed send in flight: `result` waits for the tag kept (raises `TimeoutError`; `OSError`, `ValueError`:
    not kept)."""

    def result(self, timeout: float | None = None) -> int: ...


class Relayed(Protocol):
    """Buddy copies through the workers (`axond.train.relay.RelayedCopies`): sent from the rank's copy in its worker's
    memory to the buddy's worker, read back from the node's held memory after a re-formation."""

    def forward(self, tag: int) -> Pending | None: ...

    def held(self) -> list[tuple[int, Slot, range]]: ...


POLL_S = 0.05
"""How often a wait for a relayed copy looks for the worker's word that the job moved on."""


class BuddyCopies:
    """This rank's copies sent to its buddy and held for its sources (see the module docstring)."""

    def __init__(self, zero: VirtualZero, every: int) -> None:
        if every < 1:
            raise ValueError(f"copy_every must be >= 1 (committed steps between buddy copies), got {every}")
        self.zero, self.every = zero, every
        self.works: list[Any] = []
        self.holdings: list[Holding] = []
        self.diverted: list[tuple[Holding, np.ndarray]] = []
        """The buffers the next step writes its sources' gradients into (`before_step`), kept by `after_step`."""
        self.sent = -1
        """The tag of the last copy posted to the buddy."""
        self.busy_s = 0.0
        """Seconds the training thread spent on copies (keeping gradients, posting, waiting): their cost on the step."""
        self.relayed: Relayed | None = None
        """Set: the copies go through the workers (`Relayed`), not over the group to the buddy rank's process."""
        self.unsent = 0
        """Relayed copies the buddy's worker did not confirm (unreachable, refused, or not within the group's
        timeout): until the next one lands, the buddy holds an older copy (or none)."""
        self.why_unsent = ""

    def place(self, group: ProcessGroup, nodes: list[int]) -> None:
        """The buddies of the ranks of `group` (their nodes in `nodes`); forgets the copies of the old layout."""
        self.works = []
        self.group = group
        table = buddies(nodes)
        self.buddy = table[group.rank]
        world, virtual = group.size, self.zero.virtual
        pool = self._recycled()
        self.holdings = [Holding(src, carried(src, world, virtual), []) for src in range(world)
                         if table[src] == group.rank and src != group.rank]
        if self.every > 1:  # the gradients kept between copies (every + 1) and the next step's: every + 2 buffers
            for h in self.holdings:
                size = len(h.shards) * self.zero.shard
                h.spare = [_buffer(pool, size, self.zero.flat.dtype) for _ in range(self.every + 2)]
        self.diverted = []
        self.send_scalars = np.empty(0, np.float64)

    def _recycled(self) -> dict[int, list[np.ndarray]]:
        """The old layout's gradient buffers by size, for the new one (its holdings' gradients are read by then:
        a re-formation places the copies after re-sharding, and `VirtualZero.place` took back the diverted spans)."""
        pool: dict[int, list[np.ndarray]] = {}
        if self.every == 1:  # (then the kept gradients are views of `VirtualZero.grad`, never buffers of their own)
            return pool
        holes = {id(buf) for _, buf in self.zero.holes}  # (still `grad`'s elements: never reused)
        old = [buf for h in self.holdings for buf in [*h.spare, *h.grads.values()]]
        for buf in old + [buf for _, buf in self.diverted]:
            if id(buf) not in holes:
                pool.setdefault(buf.size, []).append(buf)
        return pool

    def _buffers(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        rows, scalars = self.zero.rows_shape(count)
        return np.empty(rows, self.zero.flat.dtype), np.empty(scalars, np.float64)

    def before_step(self) -> None:
        """Before the optimizer step: with copies every few steps, the step writes its gradient of each source's
        shards straight into a buffer the holding keeps (`VirtualZero.divert`): kept between copies without a copy."""
        z = self.zero
        self.diverted = []
        if self.every > 1:
            self.diverted = [(h, h.next_buffer(len(h.shards) * z.shard, z.flat.dtype)) for h in self.holdings]
        z.divert = [(z.span(h.shards), buf) for h, buf in self.diverted]

    def after_step(self) -> None:
        """After a step was applied locally: keep its gradient for the sources' shards; post copies if due."""
        z = self.zero
        began = time.perf_counter()
        if self.every == 1:  # only this step's gradient can be needed, and `grad` holds it until the next step
            for h in self.holdings:
                h.grads = {z.grad_tag: z.grad[z.span(h.shards)]}
        written = {id(buf) for _, buf in z.holes}
        for h, buf in self.diverted:
            if id(buf) in written:
                h.keep(z.grad_tag, buf, self.every + 1)
            else:  # (not written by the step: never kept as a gradient)
                h.spare.append(buf)
        self.diverted = []
        self.busy_s += time.perf_counter() - began

    def due(self) -> bool:
        return self.zero.tag % self.every == 0

    def post(self) -> None:
        """Send this rank's block, tagged with the zero optimizer's step, to the buddy; receive the sources' copies
        (asynchronously: `settle()` waits)."""
        if self.buddy < 0:
            return
        began = time.perf_counter()
        z = self.zero
        if self.relayed is not None:  # from this rank's copy in its worker's memory, on that copy's thread
            work = self.relayed.forward(z.tag)
            self.works = [work] if work is not None else []
            self.sent = z.tag
            self.busy_s += time.perf_counter() - began
            return
        if self.send_scalars.shape != z.rows_shape(len(z.mine))[1]:
            self.send_scalars = self._buffers(len(z.mine))[1]
        batch: list[tuple[str, np.ndarray, int, int]] = [("isend", self.send_scalars, self.buddy, TAG)]
        for i, v in enumerate(z.mine):  # the arrays themselves, no copy: none changes before `settle()`
            arrays = z.arrays(v, self.send_scalars[i])
            batch += [("isend", a, self.buddy, TAG + 1 + i * len(arrays) + j) for j, a in enumerate(arrays)]
        for h in self.holdings:
            if not h.slots or h.slots[0].rows.shape != z.rows_shape(len(h.shards))[0]:
                h.slots = [Slot(*self._buffers(len(h.shards))) for _ in range(2)]
            slot = h.begin(z.tag)
            width = slot.rows.shape[1]
            batch += [("irecv", slot.scalars, h.source, TAG)]
            batch += [("irecv", slot.rows[i, j], h.source, TAG + 1 + i * width + j)
                      for i in range(len(h.shards)) for j in range(width)]
        self.works = self.group.batch_isend_irecv(batch)
        self.sent = z.tag
        self.busy_s += time.perf_counter() - began

    def settle(self) -> None:
        """Wait for the copies in flight (raises the group's error: in a live job, `MembershipChanged` once the worker
        says the job moved on, as a collective would)."""
        works, self.works = self.works, []
        began = time.perf_counter()
        if self.relayed is not None:
            try:
                for work in works:
                    self._confirmed(work)
            finally:
                self.busy_s += time.perf_counter() - began
            return
        try:
            for work in works:
                if work is not None:
                    work.wait()
        except DistributedError as e:  # an async op's error is raised as it is: make it what a collective raises
            raise surfaced(e, self.group.abort) from None
        finally:
            self.busy_s += time.perf_counter() - began
        for h in self.holdings:
            h.received()

    def _confirmed(self, work: Pending) -> None:
        """Wait for a relayed copy (never past the group's timeout); raise `MembershipChanged` if the job moves on
        meanwhile. A copy not confirmed is counted, not raised: the training state is whole, only the buddy's copy
        is older; a node lost before the next one lands falls back to the checkpoint, or fails, saying so."""
        deadline = time.monotonic() + self.group.timeout
        while True:
            try:
                work.result(timeout=POLL_S)
                return
            except TimeoutError:
                moved = moved_on(self.group)
                if moved is not None:  # (the worker gives the send up at the next request)
                    raise moved from None
                if time.monotonic() < deadline:
                    continue
                self._unsent(f"not confirmed within {self.group.timeout} s")
                return
            except (OSError, ValueError) as e:
                self._unsent(str(e))
                return

    def _unsent(self, why: str) -> None:
        """Count a relayed copy not kept, and say so (the first time, then every 100th): never silently."""
        self.unsent, self.why_unsent = self.unsent + 1, why
        if self.unsent % 100 == 1:
            warnings.warn(f"axond.train: buddy copy of step {self.sent} was not kept by the buddy's worker ({why}; "
                          f"{self.unsent} so far): until the next one lands, a node lost with this rank's shards "
                          "is rebuilt from an older copy if it can be advanced, else from the last checkpoint",
                          RuntimeWarning, stacklevel=2)

    def recovery_holdings(self) -> list[Holding]:
        """The copies this rank offers after a re-formation: relayed, every copy its node holds (with the gradients
        kept since where this rank is their buddy); else the ones it received."""
        if self.relayed is None:
            return self.holdings
        kept = {(h.shards.start, h.shards.stop): h for h in self.holdings}
        found = []
        for _, slot, shards in self.relayed.held():
            h = kept.get((shards.start, shards.stop))
            found.append(Holding(h.source if h else -1, shards, [slot], grads=h.grads if h else {}))
        return found

    def cut(self) -> None:
        """The group re-formed: the receives in flight never complete."""
        self.works = []
        for h in self.holdings:
            h.cut()
