"""Riding out a coordinator outage: whether a node whose heartbeats go unanswered keeps its ranks running.

The coordinator is not on the data path, so a node that lost it keeps training for up to the outage grace,
as long as the coordinator is what is away and not this node that is cut off (the coordinator would
declare it dead at the end of its lease and may start the job's next generation without it):

* the coordinator answered with an error (it is up and refuses this node): stop at the lease;
* a peer runs another generation (or none any more): stop;
* a peer of the same generation reaches the coordinator: it is up and has not moved the generation on; keep
  running while that lasts less than a lease (this node may just reconnect later), then stop: it is cut off;
* a peer of the same generation lost the coordinator too: an outage, keep running;
* no peer answers (or the job has none), but the coordinator's machine answers at the TCP level (its
  process is stopped, restarting or hung; it cannot declare anyone dead unanswered): keep running;
* nothing answers: this node is cut off, stop at the lease.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from axond.worker.heartbeat import Heartbeater
from axond.worker.peers import PROBE_TIMEOUT_S, PeerLink, coordinator_host_answers

Notice = Callable[[str], None]

DECIDE_AHEAD_S = PROBE_TIMEOUT_S + 0.1
"""Seconds before its lease runs out that a silent node starts deciding (asking its peers takes up to a probe's
timeout), so that a node that is cut off stops its ranks when its lease runs out, not later."""
RECONNECT_S = 1.5
"""Seconds a client may take to reconnect to a coordinator that is back (its reconnect backoff, and a call)."""


class OutageGuard:
    """Decides, while the lease is lost, whether one generation's ranks ride out the outage."""

    def __init__(self, hb: Heartbeater, link: PeerLink | None, coordinator: str, grace: float, notice: Notice) -> None:
        self._hb, self._link, self._coordinator, self._grace, self._notice = hb, link, coordinator, grace, notice
        self._next_check = 0.0
        self._riding = False
        self._stop_reason: str | None = None
        self._peer_in_contact_since: float | None = None

    def stop_reason(self) -> str | None:
        """None while the ranks may keep running (checked again at most every heartbeat interval); otherwise why
        they must stop. Call only once the lease is (about to be) lost."""
        silent = self._hb.silent_for
        lost = (f"no heartbeat was answered for {silent:.1f} s (lease {self._hb.lease:g} s; "
                f"{self._hb.last_error or 'no answer'})")
        if silent > self._grace:
            return (f"lost the coordinator's lease and the outage grace: {lost}, longer than the outage grace "
                    f"({self._grace:g} s, --outage-grace); its ranks were stopped")
        now = time.monotonic()
        if now < self._next_check:
            return self._stop_reason
        self._next_check = now + max(0.2, self._hb.interval)
        self._stop_reason = self._decide(lost)
        return self._stop_reason

    def _decide(self, lost: str) -> str | None:
        stop = f"lost the coordinator's lease: {lost}; "
        if self._hb.refused:
            return stop + "the coordinator answers but refuses this node, so its ranks were stopped"
        with ThreadPoolExecutor(1) as pool:  # both at once: the decision takes one probe's time at most
            host_answers = pool.submit(coordinator_host_answers, self._coordinator)
            views = self._link.probe() if self._link is not None else []
            reached = [v for v in views if v is not None]
        generation = self._link.generation if self._link is not None else 0
        for v in reached:
            if v.generation != generation:
                return stop + (f"node rank {v.node_rank} of the job no longer runs generation {generation}, so this "
                               "node's ranks were stopped")
        in_contact = [v for v in reached if not v.lost_coordinator]
        now = time.monotonic()
        if not in_contact:
            self._peer_in_contact_since = None
        elif self._peer_in_contact_since is None:
            self._peer_in_contact_since = now
        if in_contact and now - (self._peer_in_contact_since or now) > self._hb.lease + RECONNECT_S:
            return stop + (f"node rank {in_contact[0].node_rank} of the job reaches it and this node does not: "
                           "the coordinator has declared this node dead, so its ranks were stopped")
        if in_contact:
            return None  # it is up (just back?) and has not moved the generation on: this node's heartbeat may be next
        if reached:
            why = f"{len(reached)} of the job's other nodes lost it too"
        elif host_answers.result():
            why = "its machine answers at the TCP level but its server does not (stopped or restarting)"
        else:
            return stop + ("neither the coordinator nor any other node of the job answers: this node is cut off and "
                           "the coordinator has declared it dead, so its ranks were stopped")
        if not self._riding:
            self._riding = True
            self._notice(f"the coordinator is away ({why}): the ranks keep running for up to the outage grace "
                         f"({self._grace:g} s) while this node waits for it")
        return None

    def back(self) -> None:
        """The coordinator answers again."""
        self._peer_in_contact_since = None
        if self._riding:
            self._riding = False
            self._next_check = 0.0
            self._notice("the coordinator answers again: carrying on with the same generation")
