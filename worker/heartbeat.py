"""The heartbeat thread of a node: keeps it alive at the coordinator and hears generation changes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import grpc

from axond.control.heartbeat_stream import HeartbeatStream
from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient


_NO_ANSWER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.RESOURCE_EXHAUSTED)


def _answered(e: Exception) -> bool:
    """Whether a failed heartbeat was refused by a coordinator that is up (not lost on the way or unanswered)."""
    cause = e.__cause__
    return isinstance(cause, grpc.RpcError) and cause.code() not in _NO_ANSWER


class Heartbeater:
    """Sends one heartbeat per tracked job (or an idle one) every `interval` seconds, renewing the node's lease.

    Job runners `track` the generation they run and read the coordinator's answer with `latest`;
    `changed` is set whenever an answer arrives, so a runner can wake up at once. The lease is the
    coordinator's: a node not heard from for `lease` seconds is declared dead there, so a node whose
    heartbeats go unanswered that long must stop its ranks (`lease_lost`). Losing and regaining
    contact is announced through `notice`. Heartbeats travel over one long-lived stream
    (`HeartbeatStream`, far cheaper for the coordinator than a call each) unless `streamed` is False or
    the coordinator does not serve it (then as unary calls).
    """

    def __init__(self, client: CoordinatorClient, node_id: str, interval: float, lease: float | None = None,
                 notice: Callable[[str], None] | None = None, streamed: bool = True) -> None:
        self._client = client
        self._stream = HeartbeatStream(client, node_id) if streamed else None
        self._node_id = node_id
        self._interval = max(0.05, interval)
        self.lease = lease if lease is not None and lease > 0 else 5 * self._interval
        """Seconds without an answered heartbeat after which the node has lost its lease."""
        self._notice = notice or (lambda text: None)
        self._lost_since: float | None = None
        self._last_notice = 0.0
        self._jobs: dict[str, int] = {}
        self._pids: dict[str, Callable[[], Sequence[int]]] = {}
        self._latest: dict[str, pb.HeartbeatResponse] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.changed = threading.Event()
        self.last_ok = time.monotonic()
        """When the last answered heartbeat was *sent* (the coordinator heard it no earlier: the lease at this end
        runs out no later than at the coordinator's)."""
        self.regained_at = float("-inf")
        """When the first answered heartbeat after a failed one was sent (-inf: none failed yet)."""
        self._failing = False
        self.last_error: str = ""
        self.refused = False
        """The last heartbeat failed with an answer from the coordinator (it is up and rejects this node, e.g. it
        forgot it), not for want of one: no reason to ride out an outage."""
        self._thread = threading.Thread(target=self._loop, name=f"axond-heartbeat-{node_id}", daemon=True)

    def start(self) -> Heartbeater:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def track(self, job: str, generation: int) -> None:
        """Report that this node now runs `generation` of `job`."""
        with self._lock:
            self._jobs[job] = generation
            self._latest.pop(job, None)
            self._pids.pop(job, None)

    def report_pids(self, job: str, pids: Callable[[], Sequence[int]]) -> None:
        """Send `pids()` (each local rank's pid, 0 if not running) with the heartbeats of tracked `job`."""
        with self._lock:
            if job in self._jobs:
                self._pids[job] = pids

    def untrack(self, job: str) -> None:
        """This node no longer takes part in `job`."""
        with self._lock:
            self._jobs.pop(job, None)
            self._latest.pop(job, None)
            self._pids.pop(job, None)

    def latest(self, job: str) -> pb.HeartbeatResponse | None:
        """The coordinator's last answer about `job` since it was last tracked, or None."""
        with self._lock:
            return self._latest.get(job)

    def beat_now(self) -> None:
        """Send the heartbeats at once (instead of waiting for the next interval)."""
        self._beat()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread (bounded wait)."""
        self._stop.set()
        if self._stream is not None:
            self._stream.close()  # first: a heartbeat waiting on it ends at once
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    @property
    def silent_for(self) -> float:
        """Seconds since the last answered heartbeat."""
        return time.monotonic() - self.last_ok

    @property
    def contact_for(self) -> float:
        """Seconds since contact came back after a failed heartbeat (inf: it never failed)."""
        return time.monotonic() - self.regained_at

    @property
    def lease_lost(self) -> bool:
        """Whether no heartbeat was answered for a whole lease (the coordinator has declared this node dead)."""
        return time.monotonic() - self.last_ok > self.lease

    def _contact_lost(self, error: str) -> None:
        now = time.monotonic()
        if self._lost_since is None:
            self._lost_since = self._last_notice = now
            self._notice(
                f"lost contact with the coordinator at {self._client.address} ({error}); retrying every "
                f"{self._interval:g} s; past the lease ({self.lease:g} s) the ranks keep running only while the "
                "job's other nodes all answer and lost the coordinator too"
            )
        elif now - self._last_notice >= max(5.0, self.lease / 4):
            self._last_notice = now
            self._notice(f"still no answer from the coordinator after {now - self._lost_since:.1f} s "
                         f"(lease {self.lease:g} s)")

    def _contact_back(self) -> None:
        if self._lost_since is not None:
            self._notice(f"contact with the coordinator is back after {time.monotonic() - self._lost_since:.1f} s")
            self._lost_since = None

    def _beat(self) -> None:
        with self._lock:
            jobs = dict(self._jobs) or {"": 0}
            pids = dict(self._pids)
        for job, generation in jobs.items():
            local_pids = pids[job]() if job in pids else ()
            timeout = max(0.2, min(self._client.call_timeout, self.lease / 2))
            sent = time.monotonic()
            try:
                resp = self._send(job, generation, local_pids, timeout)
            except (CoordinatorError, ValueError) as e:
                if self._stop.is_set():  # stop() cancelled this beat's stream: no contact was lost
                    return
                self.last_error = str(e)
                self._failing = True
                self.refused = _answered(e)
                self._contact_lost(str(e).split(" (")[0][-200:])
                self.changed.set()
                continue
            self.last_ok = max(self.last_ok, sent)
            if self._failing:
                self._failing = False
                self.regained_at = sent
            self.last_error = ""
            self.refused = False
            self._contact_back()
            self._pace(resp.heartbeat_interval_s)
            with self._lock:
                if job and self._jobs.get(job) == generation:
                    self._latest[job] = resp
            self.changed.set()

    def _send(self, job: str, generation: int, local_pids: Sequence[int], timeout: float) -> pb.HeartbeatResponse:
        """One heartbeat over the stream; as a unary call without one, or when the stream failed (the unary
        call retries, and fails over between coordinator replicas)."""
        deadline = time.monotonic() + timeout
        if self._stream is not None and not self._stream.unsupported:
            try:
                return self._stream.beat(pb.HeartbeatRequest(
                    node_id=self._node_id, job=job, generation=generation,
                    node_secret=self._client.node_secret(self._node_id), local_pids=list(local_pids),
                ), timeout)
            except CoordinatorError as e:
                cause = e.__cause__
                ended = isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.UNAVAILABLE
                if self._stop.is_set() or (not ended and not self._stream.unsupported):
                    raise
        return self._client.heartbeat(self._node_id, job=job, generation=generation, local_pids=local_pids,
                                      timeout=max(0.2, deadline - time.monotonic()))

    def _pace(self, interval: float) -> None:
        """Heartbeat at the interval the coordinator asks for (it grows with the cluster), the lease with it."""
        if interval > 0 and interval != self._interval:
            self.lease *= interval / self._interval
            self._interval = interval

    @property
    def interval(self) -> float:
        """Seconds between heartbeats, as the coordinator last said."""
        return self._interval

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()
