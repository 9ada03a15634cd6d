"""Time the coordinator was not running counts against no node's lease.

A coordinator stopped (SIGSTOP, a VM pause, a long stall of its event loop) hears no heartbeat meanwhile,
through no fault of the nodes. `StallWatch` is fed the monotonic clock by the tick loop (every fraction of
a heartbeat interval) and by every heartbeat; a jump far past that cadence means the process did not run,
so every live node's lease is pushed back by the time lost, and the heartbeats answered just after (sent
during the stall and queued since, possibly by nodes that have gone meanwhile) renew no lease.
"""

from __future__ import annotations

import logging
import time

from axond.fencing import RECONNECT_ALLOWANCE_S
from axond.coordinator.state.machine import CoordinatorState

log = logging.getLogger("axond.coordinator")


class StallWatch:
    """Detects the coordinator's own stalls and re-arms the leases after each."""

    def __init__(self, state: CoordinatorState, cadence: float, quiet: float) -> None:
        """`cadence`: the longest the tick loop sleeps; a gap of more than max(1 s, 4 x cadence, one heartbeat
        interval) is a stall. `quiet`: seconds after one in which heartbeats renew no lease."""
        self._state = state
        interval = state.members.liveness.heartbeat_interval
        self.threshold = max(1.0, 4 * cadence, interval)
        self._quiet = quiet
        self._last = time.monotonic()
        self._quiet_until = float("-inf")
        self.stalls = 0
        """Stalls detected so far."""

    def observe(self, now: float) -> None:
        """The coordinator runs at `now`: re-arm the leases if it had not run for longer than the threshold."""
        gap = now - self._last
        if gap <= 0:
            return
        self._last = now
        if gap > self.threshold:
            self.stalls += 1
            # As after a restart: the time it lost counts against no lease, and every live node gets the reconnect
            # allowance on top (a node still cut off learns from its peers that the coordinator is back, and stops
            # its ranks before this lease ends: axond/fencing.py).
            nodes = self._state.rearm_leases(gap + RECONNECT_ALLOWANCE_S, now + RECONNECT_ALLOWANCE_S)
            self._quiet_until = now + self._quiet
            log.warning("the coordinator did not run for %.1f s (stopped or stalled); the leases of %d live nodes "
                        "were re-armed", gap, nodes)

    def renews(self, now: float) -> bool:
        """Whether a heartbeat answered at `now` renews its node's lease (not just after a stall)."""
        self.observe(now)
        return now >= self._quiet_until
