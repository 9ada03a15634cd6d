"""The timing that keeps two generations of a job from running at once, shared by the coordinator and the workers.

The chain, for a node cut off from the coordinator (whatever the partition answers: nothing, a refusal, a reset):

* The worker counts its lease from the moment it *sent* its last answered heartbeat; the coordinator received that
  heartbeat no earlier, so the worker's lease ends no later than the coordinator's view of it.
* Unless its peers prove an outage, the worker decides before its lease ends and has its ranks killed by the end of
  it, `fence_overrun(lease)` later at most (its probes of the peers, its monitor tick, the kill itself).
* The coordinator declares the node dead when the lease ends on its side, and starts no later generation of the
  node's job before `fence_wait(lease, fence_margin)` after that: `fence_margin` (`--fence-margin`, at least
  `FENCE_OVERRUN_S`) plus what a lease too short for the probes adds.

So the old generation's ranks are gone before the new one's start, by at least `fence_margin - FENCE_OVERRUN_S`.
"""

from __future__ import annotations

PROBE_TIMEOUT_S = 0.5
"""Seconds one probe of one peer (connect, ask, answer) may take; a worker probes its peers in parallel."""
FENCE_TERM_S = 0.5
"""Seconds a fenced worker gives its ranks between SIGTERM and SIGKILL (less if its deadline is nearer)."""
DECIDE_AHEAD_S = PROBE_TIMEOUT_S + FENCE_TERM_S + 0.1
"""Seconds before its fencing deadline that a silent worker starts deciding: the probes, then the ranks' SIGTERM
grace, all before the deadline."""
FENCE_OVERRUN_S = 0.25
"""Seconds past its deadline by which a fenced worker's ranks are dead at most: its monitor tick (0.05 s), a late
thread on a busy machine, the SIGKILL itself. The least `--fence-margin` the coordinator accepts."""
FENCE_MARGIN_S = 1.0
"""The coordinator's default `--fence-margin`."""
RECONNECT_ALLOWANCE_S = 4.0
"""Seconds added to every node's lease when the coordinator serves again (after a restart or a stall): its clients'
reconnect backoff (`RECONNECT_BACKOFF_MAX_S`), a heartbeat interval, and the room a node still cut off needs to
learn from a peer that the coordinator is back and stop its ranks before its new lease ends."""
RECONNECT_BACKOFF_MAX_S = 1.0
"""The clients' longest gRPC reconnect backoff (axond/control/channel.py's `grpc.max_reconnect_backoff_ms`)."""


def decide_at(lease: float, interval: float) -> float:
    """Seconds of silence after which a worker starts deciding whether to keep its ranks: shortly before its lease
    ends, and no earlier than half a lease plus an interval (and 0.1 s), so that a peer that lost the coordinator
    at the same moment has been silent for half a lease (`PeerView.lost_coordinator`) while one in contact has not."""
    return max(lease / 2 + interval + 0.1, lease - DECIDE_AHEAD_S)


def fence_overrun(lease: float, interval: float) -> float:
    """Seconds past its lease by which a cut-off worker's ranks are dead at most: its probes start at
    `decide_at` and take up to PROBE_TIMEOUT_S (+0.1 s), which a short lease cannot absorb."""
    return FENCE_OVERRUN_S + max(0.0, decide_at(lease, interval) + PROBE_TIMEOUT_S + 0.1 - lease)


def fence_wait(lease: float, interval: float, fence_margin: float) -> float:
    """Seconds after declaring a node dead before the coordinator starts its job's next generation."""
    return fence_margin + fence_overrun(lease, interval) - FENCE_OVERRUN_S


def contact_window(lease: float, interval: float) -> float:
    """Seconds after a peer's contact with the coordinator came back (the sending of its first answered heartbeat)
    that a node still without it may keep riding out: the coordinator, back at most `RECONNECT_BACKOFF_MAX_S`, two
    intervals and half a lease (a heartbeat call's timeout) before that, gave every node a fresh lease plus
    `RECONNECT_ALLOWANCE_S` when it came back."""
    return lease + RECONNECT_ALLOWANCE_S - RECONNECT_BACKOFF_MAX_S - 2 * interval - lease / 2


def check_fence_margin(fence_margin: float) -> None:
    """Refuse a margin the workers cannot keep (ValueError naming the value and the least one)."""
    if not fence_margin >= FENCE_OVERRUN_S:
        raise ValueError(
            f"fence_margin {fence_margin} s is below {FENCE_OVERRUN_S} s, the time a cut-off worker may take past "
            f"its lease to kill its ranks: two generations of a job could overlap; use --fence-margin >= "
            f"{FENCE_OVERRUN_S}"
        )
