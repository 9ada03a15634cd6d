"""What each rank is blocked in, published to the job's store so that a peer's timeout can say why.

A timeout alone says "no data from peer 3". Users need to know what peer 3 was doing instead, as
torch's desync debugging and flight recorder tell them. Every `ProcessGroup` notes the op it is running.
A per-process reporter thread publishes, under `axond/inflight/<global rank>` in the job's store,
the ops this rank has been blocked in for longer than `report_after(timeout)`. It publishes again when
that set changes, and an empty set once they finish. A rank that times out waiting for a peer reads
the peer's key and appends what it says to its `DistributedError`. So the message shows whether the
peer was in another op, in another group (a cross-group deadlock), or in no op at all (computing,
or stuck outside axond).

A process that `axond worker` launched also publishes the union of its groups' slow ops under its RANK in the job
generation's coordinator store, where the worker and `axond status` read them, when its groups are built on another
store (torch's): `job_report`.

Reports are JSON, never pickles. A store that fails or has gone away only loses the report; the
thread never raises. Publishing happens only for ops that are already slow, so fast ops cost three
attribute writes and no clock read.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import weakref
from typing import Any, Protocol

from axond.distributed.diagnostics.arrivals import KEY as ARRIVALS_KEY
from axond.distributed.diagnostics.arrivals import report as arrivals_report
from axond.distributed.diagnostics.flight_recorder import Dumper, HangDumps
from axond.distributed.diagnostics.job_report import JobSink, coordinator_opener, launched_env, publishes_itself
from axond.distributed.diagnostics.steps import FIELD as STEPS_FIELD
from axond.distributed.diagnostics.steps import recent as recent_steps
from axond.config import RuntimeEnv
from axond.store import Store

KEY = "axond/inflight/{}"
ARRIVALS_EVERY_S = 1.0
"""Seconds between two publications of a process's arrival windows (`arrivals`), when new windows closed."""
MAX_REPORT_AFTER = 10.0
"""Longest an op waits before its rank publishes it (a quarter of the group's timeout if that is shorter)."""


def report_after(timeout: float) -> float:
    """Seconds an op waits before its rank publishes that it is blocked in it."""
    return min(MAX_REPORT_AFTER, timeout / 4)


def hang_after(timeout: float, notice_s: float) -> float:
    """Seconds an op waits before its rank writes its hang dump (AXOND_FR_DUMP_DIR): when the worker's first "still
    waiting" notice names it (AXOND_WAIT_NOTICE_S, once the rank reports it: `report_after`; then alone if notices are
    off), or at half the group's timeout if that comes first, so that the dump is written before the op fails."""
    first = max(report_after(timeout), notice_s) if notice_s > 0 else report_after(timeout)
    return min(first, timeout / 2)


class Tracked(Protocol):
    """What the reporter reads from a process group (see `ProcessGroup`)."""

    name: str
    inflight: str | None
    """The op this member is running now (None between ops)."""
    inflight_seq: int
    """Bumped at the start of every op: the reporter times an op from when it first sees its number."""
    timeout: float


class _Member:
    """One rank's groups within this process: one process per rank, or several ranks on threads."""

    def __init__(self, store: Store, global_rank: int) -> None:
        self.store = store
        self.global_rank = global_rank
        self.groups: weakref.WeakSet[Any] = weakref.WeakSet()
        self.published: tuple[tuple[str, str, float, int], ...] = ()
        self.slow: tuple[tuple[str, str, float, int], ...] = ()
        """The slow ops found at the last look, published or not: (group, op, since as time.monotonic(), the op's
        sequence number in its group: 1 for the group's first op)."""
        self.seen: dict[int, tuple[int, float]] = {}
        """id(group) -> (op number, time.monotonic() when the reporter first saw it running)."""
        self.arrivals: dict[str, Any] = {}
        """The arrival windows of its groups as last published (`arrivals.report`)."""


class _Reporter:
    """The per-process thread that publishes slow ops; started with the first group, ended with the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: dict[tuple[int, int], _Member] = {}
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._sink: JobSink | None = None
        self._env: RuntimeEnv | None = None
        self._arrivals_at = 0.0
        self._arrivals: dict[str, Any] = {}
        self._started: float | None = None
        """Wall-clock time of this process's first arrival mark (published with the marks as "started")."""
        self._dumper: Dumper | None = None
        self._dumper_known = False
        self._hangs: HangDumps | None = None
        self._notice_s = 0.0

    def _job_sink(self) -> JobSink:
        """The process's publisher to its job's coordinator store (read from the environment once, and again when
        live recovery moved the process into a later generation: its store and its rank there are new)."""
        if self._sink is not None and self._env is not None:
            now = launched_env()
            if now is None or now.generation != self._env.generation:
                self._sink.close()
                self._sink, self._started, self._arrivals = None, None, {}  # first marks of the new generation's groups
        if self._sink is None:
            env = launched_env()
            self._sink = JobSink(KEY.format(env.rank), coordinator_opener(env)) if env is not None else JobSink("")
            self._env = env
        return self._sink

    def _publish_job(self, members: list[_Member]) -> None:
        """Publish the union of `members`' slow ops to the job's coordinator store, unless they publish there."""
        sink = self._job_sink()
        if not sink.active or self._env is None:
            return
        if publishes_itself([(m.store, m.global_rank) for m in members], self._env):
            return
        sink.publish(tuple(sorted(op for m in members for op in m.slow)))

    def _publish_arrivals(self, members: list[tuple[_Member, list[Any]]]) -> None:
        """Publish the arrival windows of the groups of a process that `axond worker` launched, at most every
        `ARRIVALS_EVERY_S`: to each member's store if it is the job's coordinator store, else through the job sink."""
        now = time.monotonic()
        sink = self._job_sink()
        if not sink.active or self._env is None or now - self._arrivals_at < ARRIVALS_EVERY_S:
            return
        self._arrivals_at = now
        union: dict[str, Any] = {}
        for m, groups in members:
            data = arrivals_report(groups)
            if data:
                data["started"] = self._first_mark(groups)
                steps = recent_steps()
                if steps:
                    data[STEPS_FIELD] = steps
            if publishes_itself([(m.store, m.global_rank)], self._env):
                if data and data != m.arrivals:
                    try:
                        m.store.set(ARRIVALS_KEY.format(m.global_rank), json.dumps(data).encode())
                        m.arrivals = data
                    except Exception:  # noqa: BLE001 - a closed or failing store only loses the report
                        pass
            else:
                union.update(data)
        if union and union != self._arrivals:
            sink.put(ARRIVALS_KEY.format(self._env.rank), json.dumps(union).encode())
            self._arrivals = union

    def _dump(self, members: list[tuple[_Member, list[Any]]]) -> None:
        """Write a Flight Recorder dump of the process's groups if its worker asked, and each rank's when one of its
        ops hangs if AXOND_FR_DUMP_DIR says where (`flight_recorder`)."""
        groups = [g for _, gs in members for g in gs]
        if not self._dumper_known:
            self._dumper_known = True
            envs = [g.options.runtime_env() for g in groups if hasattr(g, "options")]
            files = [env.failure.error_file for env in envs]
            self._dumper = Dumper(files[0]) if files and files[0] else None
            if envs and envs[0].failure.fr_dump_dir:
                self._hangs, self._notice_s = HangDumps(envs[0].failure.fr_dump_dir), envs[0].wait_notice_s
        if self._dumper is not None:
            self._dumper.check(groups)
        if self._hangs is not None:
            now = time.monotonic()
            for m, gs in members:
                hung = frozenset((id(g), g.inflight_seq) for g in gs if self._hung(m, g, now))
                self._hangs.check(m.global_rank, gs, hung)

    def _hung(self, m: _Member, g: Any, now: float) -> bool:
        """Whether `g`'s op has waited `hang_after` (timed by `_publish`, from when the reporter first saw it)."""
        seen = m.seen.get(id(g))
        return (g.inflight is not None and seen is not None and seen[0] == g.inflight_seq
                and now - seen[1] >= hang_after(g.timeout, self._notice_s))

    def _first_mark(self, groups: list[Any]) -> float:
        """When this process closed its first mark, on the wall clock (kept once found: the coordinator's goodput
        counts the job's ranks as running from the last of their first marks)."""
        if self._started is None:
            firsts = [g.windows[0][2] for g in groups if getattr(g, "windows", None)]
            if firsts:
                self._started = time.time() - (time.monotonic_ns() - min(firsts)) / 1e9
        return self._started if self._started is not None else time.time()

    def register(self, store: Store, global_rank: int, group: Tracked) -> None:
        with self._lock:
            member = self._members.get((id(store), global_rank))
            if member is None:
                member = self._members[(id(store), global_rank)] = _Member(store, global_rank)
            member.groups.add(group)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="axond-inflight", daemon=True)
                self._thread.start()
        self._wake.set()  # look again now: this group's timeout may call for a shorter tick

    def unregister(self, store: Store, global_rank: int, group: Tracked) -> None:
        with self._lock:
            member = self._members.get((id(store), global_rank))
            if member is not None:
                member.groups.discard(group)
                if not member.groups:
                    del self._members[(id(store), global_rank)]
        self._wake.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                for key in [k for k, m in self._members.items() if not m.groups]:  # groups collected undestroyed
                    del self._members[key]
                members = [(m, list(m.groups)) for m in self._members.values()]
                if not members:
                    self._thread = None
            if not members:
                self._publish_job([])  # the groups are gone: so are their slow ops
                return
            tick = 1.0
            for m, groups in members:
                try:
                    tick = min(tick, self._publish(m, groups))
                except Exception:  # noqa: BLE001 - never let a report kill the reporter
                    pass
            self._publish_job([m for m, _ in members])
            self._publish_arrivals(members)
            try:
                self._dump(members)
            except Exception:  # noqa: BLE001 - a dump is a courtesy; never let it kill the reporter
                pass
            self._wake.wait(tick)
            self._wake.clear()

    def _publish(self, m: _Member, groups: list[Any]) -> float:
        """Publish `m`'s slow ops if they changed; return how soon to look again."""
        now, tick = time.monotonic(), 1.0
        slow, seen = [], {}
        for g in groups:
            after = report_after(g.timeout)
            tick = min(tick, max(after / 2, 0.05))
            op, seq = g.inflight, g.inflight_seq
            if op is None:
                continue
            first = m.seen.get(id(g))
            since = first[1] if first is not None and first[0] == seq else now
            seen[id(g)] = (seq, since)
            if now - since >= after:
                slow.append((g.name, op, since, seq))
        m.seen = seen
        ops = tuple(sorted(slow))
        m.slow = ops
        if ops == m.published:
            return tick
        wall = time.time()
        report = {"pid": os.getpid(), "host": socket.gethostname(), "at": wall,
                  "ops": [{"group": g, "op": op, "since": wall - (now - since), "seq": seq}
                          for g, op, since, seq in ops]}
        try:
            m.store.set(KEY.format(m.global_rank), json.dumps(report).encode())
            m.published = ops
        except Exception:  # noqa: BLE001 - a closed or failing store only loses the report
            pass
        return tick


REPORTER = _Reporter()


Blocked = list[tuple[str, str, float]]
"""(group, op, since as wall-clock seconds) of each op a rank reported being blocked in."""


def read_report(store: Store, global_rank: int) -> tuple[Blocked, str]:
    """What rank `global_rank` last published: its blocked ops and where it runs ("pid P on HOST").

    No report reads as no blocked op. Raises `ValueError` for an unreadable one, and the store's errors as they are.
    """
    raw = store.try_get(KEY.format(global_rank))
    try:
        report = json.loads(raw) if raw is not None else {}
        ops = [(str(o["group"]), str(o["op"]), float(o["since"])) for o in report.get("ops", [])]
        return ops, (f"pid {int(report['pid'])} on {report['host']}" if ops else "")
    except (TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"unreadable in-flight report of rank {global_rank}") from e


def blocked_text(ops: Blocked, now: float | None = None) -> str:
    """`op on group 'g' for 3.1 s`, joined by "; and in " for several."""
    now = time.time() if now is None else now
    return "; and in ".join(f"{op} on group '{group}' for {max(now - since, 0.0):.1f} s" for group, op, since in ops)


def describe(store: Store, global_rank: int, group_rank: int, timeout: float,
             mine: tuple[str, str] | None = None) -> str:
    """What peer `global_rank` last published about itself, as a clause for a timeout message.

    `mine` is this rank's (group, op): a peer blocked elsewhere is called out as out of step.
    """
    return _clause(store, global_rank, group_rank, timeout, mine)[0]


def _clause(store: Store, global_rank: int, group_rank: int, timeout: float,
            mine: tuple[str, str] | None) -> tuple[str, str]:
    """(`describe`'s clause, "same" if the peer is blocked in `mine` too, "down" if the store failed, else "")."""
    who = f"peer rank {group_rank}" + (f" (global rank {global_rank})" if global_rank != group_rank else "")
    try:
        ops, where = read_report(store, global_rank)
    except ValueError:
        return f"{who} published an unreadable report", ""
    except Exception:  # noqa: BLE001 - the report is a hint; the timeout is the error
        return f"{who} could not be asked what it is doing (the store did not answer)", "down"
    if not ops:
        return (f"{who} reports no op blocked for over {report_after(timeout):.1f} s: it is outside axond "
                "(computing, or stuck in its own code), or entered its op only just now"), ""
    text = f"{who} ({where}) is blocked in {blocked_text(ops)}"
    if mine is None:
        return text, ""
    if any((group, op) == mine for group, op, _ in ops):
        return text, "same"
    return text + f", not in {mine[1]} on group '{mine[0]}': the ranks issued their ops in different orders", ""


MAX_DESCRIBED_PEERS = 16
"""Peers whose reports a group-wide description reads at most (each is one store read)."""


def describe_others(store: Store, ranks: list[int], me: int, timeout: float, mine: tuple[str, str]) -> str:
    """For a collective that timed out without naming a peer (NCCL): which members are not in it, and where.

    `ranks` are the group's global ranks, `me` this rank's group rank, `mine` its (group, op). Members
    blocked in the same op are only counted; if all are, the op itself stalls rather than the ranks disagreeing.
    """
    others = [r for r in range(len(ranks)) if r != me]
    clauses, same, asked = [], 0, 0
    for group_rank in others[:MAX_DESCRIBED_PEERS]:
        text, state = _clause(store, ranks[group_rank], group_rank, timeout, mine)
        asked += 1
        if state == "same":
            same += 1
        else:
            clauses.append(text)
        if state == "down":  # each further read would wait for the store's timeout too
            break
    unread = len(others) - asked
    tail = f" ({unread} more not asked)" if unread else ""
    if not clauses:
        return (f"every peer asked ({same}) is blocked in {mine[1]} on group '{mine[0]}' too{tail}: the ranks agree "
                "on the op, which itself stalls (a device, driver or network hang)")
    text = "; ".join(clauses)
    if same:
        text += f"; {same} other peer{'s' if same > 1 else ''} {'are' if same > 1 else 'is'} blocked in it too"
    return text + tail
