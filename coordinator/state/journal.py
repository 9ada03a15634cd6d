"""What changed in the state machine since the last commit, and how a state is rebuilt from a commit.

`TxLock` is the state's re-entrant lock: when the outermost holder releases it, it calls its
`on_release`. Without the server's group commit that commits the changes marked in the `Journal`
(read from the live objects) in one transaction before the call returns (state-level tests,
`bench/rendezvous.py`); with it, it only tells the committer (`group_commit.py`) that a batch is
due. `restore` rebuilds a state from what was committed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from axond.coordinator.state.jobs import EventLog
from axond.coordinator.state.kv_space import ARRIVAL_OVERHEAD, KvSpace
from axond.coordinator.state import records
from axond.coordinator.state.port import Changes, JoinerChanges, Record, Snapshot
from axond.fencing import fence_wait
from axond.coordinator.state.rendezvous import Round

if TYPE_CHECKING:
    from axond.coordinator.state.machine import CoordinatorState


class TxLock:
    """A re-entrant lock that calls `on_release` when its outermost holder releases it."""

    def __init__(self, on_release: Callable[[], None]) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self.on_release = on_release
        """Called at the end of every outermost hold, still under the lock."""

    def __enter__(self) -> TxLock:
        self._lock.acquire()
        self._depth += 1
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if self._depth == 1:
                self.on_release()
        finally:
            self._depth -= 1
            self._lock.release()


@dataclass
class Journal:
    """Names of what changed since the last commit."""

    jobs: set[str] = field(default_factory=set)
    replaced_jobs: set[str] = field(default_factory=set)
    cleared_stores: set[str] = field(default_factory=set)
    kv: set[tuple[str, str]] = field(default_factory=set)
    barriers: set[tuple[str, str]] = field(default_factory=set)
    meta: bool = False
    events_saved: dict[str, int] = field(default_factory=dict)
    """Per job: absolute index of the first event not committed yet."""
    past_saved: dict[str, list[Round]] = field(default_factory=dict)
    """Per job: the past rounds whose records are committed."""
    rounds_saved: dict[str, Round] = field(default_factory=dict)
    """Per job: the round whose joiner rows are committed (another round: all its joiners are written anew)."""

    def job_replaced(self, name: str) -> None:
        """A job of this name was forgotten or started anew: its old record, store and events go."""
        self.replaced_jobs.add(name)
        self.jobs.add(name)
        self.events_saved[name] = 0
        self.rounds_saved.pop(name, None)
        self.past_saved.pop(name, None)
        self.kv = {k for k in self.kv if k[0] != name}
        self.barriers = {k for k in self.barriers if k[0] != name}

    def store_cleared(self, name: str) -> None:
        self.cleared_stores.add(name)
        self.kv = {k for k in self.kv if k[0] != name}
        self.barriers = {k for k in self.barriers if k[0] != name}

    def marked(self, state: CoordinatorState) -> bool:
        """Whether anything changed since the last `changes` (cheap: called at the end of every call)."""
        members = state.members
        return bool(self.jobs or self.kv or self.barriers or self.meta or self.replaced_jobs or self.cleared_stores
                    or members.changed or members.forgotten)

    def _joiners(self, name: str, rnd: Round) -> JoinerChanges:
        """The joiner rows of `name`'s current round to write: those changed since the last commit (O(1) per
        Join), or all of them when the round is not the one committed or its order changed."""
        reset = rnd.reordered or self.rounds_saved.get(name) is not rnd
        changed = rnd.joiners if reset else rnd.dirty
        rows = {node_id: records.joiner_row(rnd, node_id) for node_id in changed}
        rnd.dirty = {}
        rnd.reordered = False
        self.rounds_saved[name] = rnd
        return JoinerChanges(rnd.generation, reset, rows)

    def _past_rounds(self, c: Changes, name: str, past: list[Round]) -> None:
        """Write the records of rounds archived since the last commit (once each), drop those let go."""
        saved = self.past_saved.get(name, [])
        if len(saved) == len(past) and all(a is b for a, b in zip(saved, past)):
            return
        kept = {id(r) for r in past}
        written = {id(r) for r in saved}
        rows: dict[int, Record | None] = {r.generation: None for r in saved if id(r) not in kept}
        rows.update({r.generation: records.past_round_record(r) for r in past if id(r) not in written})
        c.past_rounds[name] = rows
        self.past_saved[name] = list(past)

    def changes(self, state: CoordinatorState, now: float) -> Changes:
        """Read the marked objects from `state` into one `Changes`, and start over."""
        c = Changes()
        members = state.members
        for node_id in members.forgotten:
            c.deleted_nodes.add(node_id)
        for node_id in members.changed:
            node = members.nodes.get(node_id)
            if node is None:
                c.deleted_nodes.add(node_id)
            else:
                c.deleted_nodes.discard(node_id)
                c.nodes[node_id] = records.node_record(node)
        members.changed.clear()
        members.forgotten.clear()
        c.deleted_jobs = set(self.replaced_jobs)
        c.cleared_stores = set(self.cleared_stores)
        for name in self.jobs:
            j = state.jobs.get(name)
            if j is None:
                c.deleted_jobs.add(name)
                self.events_saved.pop(name, None)
                self.rounds_saved.pop(name, None)
                self.past_saved.pop(name, None)
                continue
            c.jobs[name] = records.job_record(j, now)
            c.joiners[name] = self._joiners(name, j.round)
            self._past_rounds(c, name, j.past_rounds)
            saved = self.events_saved.get(name, 0)
            if j.events.end > saved:
                events, end, _ = j.events.read(saved)
                c.events[name] = (end - len(events), [records.event_record(e) for e in events])
                self.events_saved[name] = end
        for job, key in self.kv:
            j = state.jobs.get(job)
            if j is not None:
                c.kv[(job, key)] = (j.generation, j.kv.data.get(key))
        for job, name in self.barriers:
            j = state.jobs.get(job)
            barrier = j.kv.barriers.get(name) if j is not None else None
            if j is not None and barrier is not None:
                c.barriers[(job, name)] = (j.generation, records.barrier_record(barrier))
        if self.meta:
            s = state.scheduler
            c.meta = records.scheduler_meta(s.queue, s.deliveries, s.cancels, state.submitted.job_seq, members._seq)
        self.jobs.clear()
        self.replaced_jobs.clear()
        self.cleared_stores.clear()
        self.kv.clear()
        self.barriers.clear()
        self.meta = False
        return c


def restore(state: CoordinatorState, snap: Snapshot, now: float) -> None:
    """Fill a new, empty `state` with what was committed; every node gets a fresh lease from `now`."""
    members = state.members
    journal = state.journal
    assert journal is not None, "restore fills a durable state"
    for r in snap.nodes:
        node = records.node_from(r, now)
        members.nodes[node.node_id] = node
    joiners: dict[tuple[str, int], list[tuple[str, list[Any]]]] = {}
    for job, gen, node_id, row in snap.joiners:
        joiners.setdefault((job, gen), []).append((node_id, row))
    past: dict[str, dict[int, Any]] = {}
    for job, gen, record in snap.past_rounds:
        past.setdefault(job, {})[gen] = record
    for r in snap.jobs:
        log = EventLog(state.limits.max_output_bytes_per_job)
        log.base, events = snap.events.get(r["name"], (0, []))
        for e in events:
            log.append(records.event_from(e))
        j = records.job_from(r, now, log, joiners.get((r["name"], int(r["round"]["generation"]))),
                             past.get(r["name"]))
        j.kv = KvSpace(state.limits, state.budget)
        state.jobs[j.name] = j
        journal.events_saved[j.name] = log.end
        if "joiners" not in r["round"]:  # its joiners are committed as rows (an older record holding them is
            # not: its next commit writes them all as rows)
            journal.rounds_saved[j.name] = j.round
        if "past_rounds" not in r:  # likewise its past rounds
            journal.past_saved[j.name] = list(j.past_rounds)
    for job, gen, key, value in snap.kv:
        held = state.jobs.get(job)
        if held is not None and held.generation == gen:
            held.kv.restore(key, value)
    for job, gen, name, r in snap.barriers:
        held = state.jobs.get(job)
        if held is not None and held.generation == gen:
            barrier = held.kv.barriers[name] = records.barrier_from(r)
            held.kv._charge(len(name) + ARRIVAL_OVERHEAD + sum(len(a) + ARRIVAL_OVERHEAD for a in barrier.arrivals),
                            check=False)
    _fence_after_restart(state, now)
    meta = snap.meta or {}
    state.scheduler.queue = list(meta.get("queue", []))
    state.scheduler.deliveries = {k: list(v) for k, v in meta.get("deliveries", {}).items()}
    state.scheduler.cancels = {k: list(v) for k, v in meta.get("cancels", {}).items()}
    state.submitted.job_seq = int(meta.get("job_seq", 0))
    members._seq = max([int(meta.get("node_seq", 0))] + [n.seq for n in members.nodes.values()])


def _fence_after_restart(state: CoordinatorState, now: float) -> None:
    """No open round of a restored job freezes before a whole fence wait from `now`: a node declared dead just before
    the crash may still be killing its ranks, and the time set for that (`Round.not_before`) is not kept."""
    liveness = state.members.liveness
    interval = max([liveness.heartbeat_interval] + [state.members.paced(n) for n in state.members.nodes.values()])
    wait = fence_wait(interval * liveness.dead_after_missed, interval, state.failures.fence_margin)
    for j in state.jobs.values():
        if not j.state.terminal and not j.round.frozen:
            j.round.not_before = max(j.round.not_before, now + wait)
