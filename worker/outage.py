"""Riding out a coordinator outage: whether a node whose heartbeats go unanswered keeps its ranks running.

The coordinator is not on the data path, so a node that lost it keeps training for up to the outage grace, but
only on evidence that the coordinator is what is away, evidence a node cut off from it cannot have: the
coordinator declares a cut-off node dead at the end of its lease and may start the job's next generation
without it. A refused connection to the coordinator's address is no such evidence (a firewall answers so too).

* the coordinator answered with an error (it is up and refuses this node): stop by the lease;
* the job has no other node, or this node does not know their addresses yet: nothing can vouch; stop by the lease;
* a known peer of the generation does not answer (it moved on, or this node is cut off from it too): stop;
* a peer runs another generation (or none any more): stop;
* a peer reaches the coordinator: it is up. If this node was riding out an outage (every peer had lost it) and the
  peer's contact came back just now, the coordinator came back just now and gave every node a fresh lease
  (`contact_window`): keep running until shortly before that lease can have run out, then stop (this node is
  cut off); otherwise stop at once;
* every known peer answers, in this generation, and lost the coordinator too: an outage, keep running.

Whenever it stops, the ranks are dead by the fencing deadline (`fence_deadline`), the earliest time the
coordinator may have declared this node dead (see axond/fencing.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from axond.fencing import FENCE_TERM_S, contact_window, decide_at
from axond.worker.heartbeat import Heartbeater
from axond.worker.peers import PeerLink, PeerView

Notice = Callable[[str], None]

_STOP_AHEAD_S = FENCE_TERM_S + 0.1
"""Seconds before the coordinator's fresh lease can end that a node still cut off stops its ranks (no probe needed)."""


class OutageGuard:
    """Decides, while the lease is lost, whether one generation's ranks ride out the outage."""

    def __init__(self, hb: Heartbeater, link: PeerLink | None, grace: float, notice: Notice) -> None:
        self._hb, self._link, self._grace, self._notice = hb, link, grace, notice
        self._next_check = 0.0
        self._riding = False
        self._verdict: tuple[bool, str] | None = None
        """The last evidence's verdict: None (keep running), or (whether the job moved on, why the ranks stop)."""
        self._coordinator_back_by: float | None = None
        """While riding and a peer's contact came back: the fencing deadline its fresh lease sets this node."""

    def deciding(self) -> bool:
        """Whether the ranks' fate is to be decided now (silent long enough that the decision must be made by the
        fencing deadline); False when contact is back."""
        if self._hb.silent_for > decide_at(self._hb.lease, self._hb.interval):
            return True
        self.back()
        return False

    def fence_deadline(self) -> float:
        """The monotonic time by which the ranks must be dead unless an outage is proven: the end of this node's
        lease (counted from the sending of its last answered heartbeat), or, once a peer is back in contact, the end
        of the fresh lease the coordinator gave every node when it came back."""
        lease_end = self._hb.last_ok + self._hb.lease
        if self._coordinator_back_by is not None:
            return max(lease_end, self._coordinator_back_by)
        return lease_end

    def stop_reason(self) -> str | None:
        """None while the ranks may keep running; otherwise why they must stop. The evidence is gathered again at
        most every heartbeat interval; a verdict to stop takes effect at once when the job moved on, else only
        shortly before the fencing deadline (contact may come back before). Call only once `deciding()`."""
        silent = self._hb.silent_for
        lost = (f"no heartbeat was answered for {silent:.1f} s (lease {self._hb.lease:g} s; "
                f"{self._hb.last_error or 'no answer'})")
        if silent > self._grace:
            return (f"lost the coordinator's lease and the outage grace: {lost}, longer than the outage grace "
                    f"({self._grace:g} s, --outage-grace); its ranks were stopped")
        now = time.monotonic()
        if self._coordinator_back_by is not None and now >= self._coordinator_back_by - _STOP_AHEAD_S:
            return (f"lost the coordinator's lease: {lost}; the job's other nodes reach the coordinator again and "
                    "this node does not: it is cut off and the coordinator declares it dead, so its ranks were stopped")
        if now >= self._next_check:
            self._next_check = now + max(0.2, self._hb.interval)
            self._verdict = self._decide(lost, now)
        if self._verdict is None:
            return None
        moved_on, why = self._verdict
        if moved_on or time.monotonic() >= self.fence_deadline() - _STOP_AHEAD_S:
            return why
        return None

    def _decide(self, lost: str, asked_at: float) -> tuple[bool, str] | None:
        stop = f"lost the coordinator's lease: {lost}; "
        if self._hb.refused:
            return False, stop + "the coordinator answers but refuses this node, so its ranks were stopped"
        link = self._link
        if link is None or not link.peers:
            return False, stop + ("no other node of the job can vouch that the coordinator itself is away (a refused "
                                  "or unanswered connection does not prove it), so its ranks were stopped")
        ranks = sorted(link.peers)
        views = link.probe()
        silent = [rank for rank, v in zip(ranks, views) if v is None]
        if silent:
            return False, stop + (f"node rank {silent[0]} of the job, which this node knew, does not answer (the job "
                                  "moved on, or this node is cut off from it too), so its ranks were stopped")
        reached: list[PeerView] = [v for v in views if v is not None]
        for v in reached:
            if v.generation != link.generation:
                return True, stop + (f"node rank {v.node_rank} of the job no longer runs generation "
                                     f"{link.generation}, so this node's ranks were stopped")
        in_contact = [v for v in reached if not v.lost_coordinator]
        if in_contact:
            return self._peer_in_contact(stop, in_contact, asked_at)
        self._coordinator_back_by = None
        if not self._riding:
            self._riding = True
            self._notice(f"the coordinator is away ({len(reached)} of the job's other nodes lost it too): the ranks "
                         f"keep running for up to the outage grace ({self._grace:g} s) while this node waits for it")
        return None

    def _peer_in_contact(self, stop: str, in_contact: list[PeerView], asked_at: float) -> tuple[bool, str] | None:
        """A peer reaches the coordinator and this node does not: cut off, unless the coordinator just came back
        from an outage this node was riding out (then it stops before the coordinator's fresh lease can end)."""
        peer = in_contact[0]
        why = (f"node rank {peer.node_rank} of the job reaches it and this node does not: the coordinator declares "
               "this node dead, so its ranks were stopped")
        if not self._riding:
            return False, stop + why
        back_by = min(asked_at - v.contact_for for v in in_contact) + contact_window(self._hb.lease, self._hb.interval)
        if self._coordinator_back_by is None or back_by < self._coordinator_back_by:
            self._coordinator_back_by = back_by
        if time.monotonic() >= self._coordinator_back_by - _STOP_AHEAD_S:
            return False, stop + why
        return None

    def back(self) -> None:
        """The coordinator answers again."""
        self._coordinator_back_by = None
        self._verdict = None
        if self._riding:
            self._riding = False
            self._next_check = 0.0
            self._notice("the coordinator answers again: carrying on with the same generation")
