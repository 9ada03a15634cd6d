"""Live recovery on the worker's side of a cut link between two nodes that both keep their leases.

Nothing dies and no lease runs out: the collective between the two stalls until the group's timeout (what bounds the
detection: `init_process_group(timeout=...)`), the rank that times out tells the others (an abort frame), and every
rank whose collective failed asks its worker to hear from the coordinator (its nudge file, which also names the failed
op, group and peer). At the first such request of a generation the worker probes its peers' nodes (`PeerLink`: a
connection that nothing answers, twice within `PROBE_TIMEOUT_S`, is a cut link; a refused one is a live host), on a
thread of its own so that its monitor loop goes on, and reports the node ranks it cannot reach while its ranks keep
running. The coordinator decides which node the job goes on without (`axond.coordinator.state.linkcut`): the worker
of that node stops its ranks and leaves (or re-joins with restarts left); the others re-form live as after a death.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

from axond.distributed.membership import nudge_path
from axond.worker.peers import PeerLink


RECHECK_S = 0.5
"""How often a node left out for a cut link probes the nodes it could not reach before it re-joins."""


class LinkCheck:
    """One generation's probe of the peers' nodes, started by the first nudge written after `since` (wall time)."""

    def __init__(self, link: PeerLink | None, membership_paths: list[str], since: float) -> None:
        self._link = link
        self._paths = [nudge_path(p) for p in membership_paths]
        self._since = since
        self._thread: threading.Thread | None = None
        self._found: list[int] | None = None
        self.cause = ""
        """What the rank that asked first wrote: its failed collective (op, group, peer)."""
        self.reported = False

    def _asked(self) -> str | None:
        """The cause written by a local rank that asked since this generation began, or None if none asked."""
        for path in self._paths:
            with contextlib.suppress(OSError):
                if os.stat(path).st_mtime >= self._since:
                    with open(path, encoding="utf-8", errors="replace") as f:
                        return f.read(1000)
        return None

    def _probe(self) -> None:
        assert self._link is not None
        try:
            self._found = self._link.unreachable()
        except Exception:  # noqa: BLE001 - a failed probe finds nothing: the job's usual path goes on
            self._found = []

    def poll(self) -> list[int] | None:
        """Start the probe at the first request; the node ranks found unreachable once it ended (once, and only when
        there are some), else None."""
        if self._link is None or self.reported:
            return None
        if self._thread is None:
            cause = self._asked()
            if cause is None:
                return None
            self.cause = cause
            self._thread = threading.Thread(target=self._probe, name="axond-link-check", daemon=True)
            self._thread.start()
            return None
        if self._thread.is_alive() or not self._found:
            return None
        self.reported = True
        return self._found

    def settle(self, timeout: float) -> list[int] | None:
        """`poll`, after waiting up to `timeout` for a probe under way (the job moved on meanwhile)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.poll()

    def wait_reachable(self, lost: list[int], timeout: float, stopped: Callable[[], bool]) -> bool:
        """After this node was left out for a cut link, with restarts left: wait (up to `timeout`) until the nodes it
        could not reach answer a connection again (their listener of the generation before is closed by now: a refusal
        is the answer), so that its worker re-joins only over a link that works. False if it did not come back."""
        if self._link is None:
            return True
        deadline = time.monotonic() + timeout
        while not stopped():
            if not set(self._link.unreachable(tries=1)) & set(lost):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(RECHECK_S)
        return False

    def address(self, node_rank: int) -> str:
        """Where node rank `node_rank` was probed (host:port), for messages."""
        host, port = self._link.peers.get(node_rank, ("?", 0)) if self._link is not None else ("?", 0)
        return f"{host}:{port}"
