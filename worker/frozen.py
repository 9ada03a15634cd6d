"""Live recovery of a frozen rank: a local rank stopped (SIGSTOP) for longer than the node's lease is a failed rank.

A stopped process keeps its sockets open and its worker keeps heartbeating, so nothing else tells the coordinator
which node to go on without: the survivors would wait in a collective until the group's timeout. Under
`axond worker --live-recovery` the worker looks at each local rank's state (`/proc/PID/stat`: 'T' stopped, 't'
stopped by a tracer); one that stays stopped for longer than the lease (heartbeat interval x missed heartbeats, the
time the coordinator gives a silent node) is SIGKILLed (a stopped process dies on SIGKILL) and its exit takes the
failed rank's path: its sockets close (the survivors' collectives fail at once and wait for the worker's word), the
worker reports it, and the coordinator re-forms the job live without this node.
"""

from __future__ import annotations

import signal
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from axond.worker.stacks import process_state

if TYPE_CHECKING:
    from axond.worker.launcher import LocalRanks, RankExit

STOPPED_STATES = ("T", "t")
"""`/proc/PID/stat` states of a stopped process: by a signal (SIGSTOP, SIGTSTP) or by a tracer."""


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped now (False if it is gone, or this is not Linux)."""
    return process_state(pid) in STOPPED_STATES


class FrozenWatch:
    """Kills the local ranks that stay stopped for longer than `lease` seconds and remembers why."""

    def __init__(self, ranks: LocalRanks, lease: float, active: bool = True) -> None:
        self._ranks = ranks
        self.lease = lease
        self.active = active
        """Only in live jobs: elsewhere a stopped rank is left to the group's timeout, as the user may mean it."""
        self._since: dict[int, float] = {}
        """Local rank -> when (monotonic) it was first seen stopped, in its current stop."""
        self.killed: dict[int, str] = {}
        """Local rank -> why the worker killed it."""

    def check(self, now: float | None = None) -> list[str]:
        """Look at every running local rank; SIGKILL those stopped for longer than the lease. Returns one line per
        rank killed now (`rank N (pid P) was stopped (SIGSTOP) for S s, ...`)."""
        if not self.active:
            return []
        now = time.monotonic() if now is None else now
        lines = []
        for r, pid in zip(self._ranks.ranks, self._ranks.local_pids()):
            local = r.spec.local_rank
            if not pid or local in self.killed or not stopped(pid):
                self._since.pop(local, None)
                continue
            since = self._since.setdefault(local, now)
            if now - since <= self.lease:
                continue
            why = (f"stopped (SIGSTOP) for {now - since:.1f} s, longer than the node's lease ({self.lease:g} s): "
                   "the worker killed it")
            self.killed[local] = why
            r.signal_group(signal.SIGKILL)
            lines.append(f"rank {r.spec.rank} was {why} (pid {pid})")
        return lines

    def explain(self, failure: RankExit) -> RankExit:
        """`failure` with the stop as its cause if the worker killed that rank for it (its SIGKILL was ours)."""
        why = self.killed.get(failure.local_rank)
        return failure if why is None else replace(failure, message=why)
