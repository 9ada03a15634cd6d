"""Daemon mode: a registered node that runs the ranks of jobs submitted with `axond run`.

The daemon long-polls the coordinator for work; each assignment runs in its own `JobRunner`
thread whose output lines go back to the coordinator in bounded batches (`OutputForwarder`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb
from axond.worker.agent import JobOutcome, JobRunner, Notice, notice_to_stderr
from axond.worker.heartbeat import Heartbeater
from axond.worker.node import connect_and_register, leave, register
from axond.worker.spec import DEFAULT_OUTAGE_GRACE_S, ConnectOptions, JobSpec

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient

CANCELLED_EXIT_CODE = 130
"""Exit code a cancelled job's ranks are reported with (as if interrupted by Ctrl-C)."""


_daemon_notice = notice_to_stderr("axond worker (daemon)")


@dataclass(frozen=True)
class DaemonConfig:
    """Options of a worker daemon."""

    slots: int = 1
    """Rank processes this node offers to submitted jobs."""
    poll_wait: float = 2.0
    """Seconds one PollWork long-poll may wait for an assignment."""
    stop_grace: float = 5.0
    """Seconds between SIGTERM and SIGKILL when stopping ranks."""
    join_timeout: float = 300.0
    """Seconds a job's rendezvous may take before the node gives up on it."""
    outage_grace: float = DEFAULT_OUTAGE_GRACE_S
    """Seconds a job's ranks keep running while the coordinator is away (see worker/outage.py)."""

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"--slots must be >= 1, got {self.slots}")
        if self.poll_wait <= 0:
            raise ValueError(f"poll wait must be > 0, got {self.poll_wait}")


class OutputForwarder:
    """Collects rank output lines and pushes them to the coordinator in batches.

    One thread sends a batch at a time; lines printed meanwhile make up the next batch. The queue
    is bounded (`max_pending` lines): when ranks print faster than the coordinator takes lines,
    the excess is dropped and counted, and a notice line says how many were lost.
    """

    def __init__(
        self,
        client: CoordinatorClient,
        job: str,
        node_id: str,
        max_pending: int = 10_000,
        max_batch_lines: int = 512,
        max_batch_bytes: int = 1 << 20,
        retry_interval: float = 0.2,
    ) -> None:
        self._client, self._job, self._node_id = client, job, node_id
        self._max_pending, self._max_lines, self._max_bytes = max_pending, max_batch_lines, max_batch_bytes
        self._retry_interval = retry_interval
        self._pending: deque[pb.OutputLine] = deque()
        self._dropped = 0
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=f"axond-output-{job}", daemon=True)
        self._thread.start()

    def sink(self, rank: int, stream: str, text: str) -> None:
        """An `OutputSink`: queue one line (never blocks on the network)."""
        with self._cond:
            if len(self._pending) >= self._max_pending:
                self._dropped += 1
                return
            self._pending.append(pb.OutputLine(rank=rank, stream=stream, text=text))
            self._cond.notify_all()

    def _take_batch(self) -> list[pb.OutputLine]:
        """Up to `max_batch_lines` lines / `max_batch_bytes` characters; the caller holds the lock."""
        if self._dropped:
            self._pending.append(pb.OutputLine(
                rank=-1, stream="stderr",
                text=f"axond: {self._dropped} output lines dropped (ranks printed faster than they could be sent)",
            ))
            self._dropped = 0
        batch: list[pb.OutputLine] = []
        size = 0
        while self._pending and len(batch) < self._max_lines:
            size += len(self._pending[0].text) + 16
            if batch and size > self._max_bytes:
                break
            batch.append(self._pending.popleft())
        self._in_flight = len(batch)
        return batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._dropped and not self._closing:
                    self._cond.wait(1.0)
                if self._closing and not self._pending and not self._dropped:
                    return
                batch = self._take_batch()
            try:
                self._client.push_output(self._job, self._node_id, batch)
                failed = False
            except (CoordinatorError, ValueError):
                failed = True
            with self._cond:
                self._in_flight = 0
                if failed:
                    if self._closing:
                        self._pending.clear()
                        self._dropped = 0
                    else:
                        self._dropped += len(batch)
                self._cond.notify_all()
            if failed:
                time.sleep(self._retry_interval)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait (bounded) until every line queued so far was sent or given up on."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._pending or self._in_flight) and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (bounded by `timeout`), then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)


class _JobThread:
    """One assignment being run by the daemon."""

    def __init__(self, runner: JobRunner, forwarder: OutputForwarder, notice: Notice) -> None:
        self.runner = runner
        self.outcome: JobOutcome | None = None
        self._forwarder = forwarder
        self._notice = notice
        self.thread = threading.Thread(target=self._main, name="axond-daemon-job", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.outcome = self.runner.run()
        except Exception as e:  # noqa: BLE001 - a bug in one job must not take the daemon down
            self.outcome = JobOutcome(1, f"daemon job error: {type(e).__name__}: {e}")
        finally:
            self._forwarder.close()
        if self.outcome.exit_code:
            outcome = self.outcome
            self._notice(f"job {self.runner.job!r} ended with exit code {outcome.exit_code}: {outcome.message}")
        else:
            self._notice(f"job {self.runner.job!r} finished: every local rank exited 0")


def _is_not_found(e: Exception) -> bool:
    cause = e.__cause__
    return isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.NOT_FOUND


class RunningDaemon:
    """A worker daemon polling for work in a thread; returned by `start_daemon`."""

    def __init__(
        self, client: CoordinatorClient, conn: ConnectOptions, node_id: str, hb: Heartbeater,
        config: DaemonConfig, notice: Notice,
    ) -> None:
        self.node_id = node_id
        self._client, self._conn, self._hb, self._config, self._notice = client, conn, hb, config, notice
        self._jobs: dict[str, _JobThread] = {}
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="axond-daemon", daemon=True)
        self._thread.start()

    def _start_job(self, work: pb.WorkAssignment) -> None:
        cwd = work.cwd if work.cwd and os.path.isdir(work.cwd) else None
        if work.cwd and cwd is None:
            self._notice(f"job {work.job!r}: directory {work.cwd!r} does not exist here; running in {os.getcwd()!r}")
        try:
            spec = JobSpec(
                argv=tuple(work.argv), job=work.job, nproc_per_node=work.nproc_per_node,
                min_nodes=work.min_nodes or work.nnodes, max_nodes=work.nnodes, max_restarts=work.max_restarts,
                live_recovery=work.live_recovery,
                env=dict(work.env), cwd=cwd, join_timeout=self._config.join_timeout,
                stop_grace=self._config.stop_grace, outage_grace=self._config.outage_grace,
            )
        except ValueError as e:
            self._notice(f"job {work.job!r} rejected: {e}")
            return
        forwarder = OutputForwarder(self._client, work.job, self.node_id)
        runner = JobRunner(
            self._client, self._conn, self.node_id, self._hb, spec,
            sink=forwarder.sink, notice=lambda text: self._notice(text), flush=forwarder.flush,
        )
        self._jobs[work.job] = _JobThread(runner, forwarder, self._notice)

    def _loop(self) -> None:
        backoff = 0.0
        try:
            while not self._stop.is_set():
                for name in [n for n, j in self._jobs.items() if not j.thread.is_alive()]:
                    del self._jobs[name]
                try:
                    reply = self._client.poll_work(self.node_id, self._config.poll_wait)
                except (CoordinatorError, ValueError) as e:
                    if self._stop.is_set():
                        break
                    if _is_not_found(e) and not self._jobs and self._reregister():
                        continue
                    backoff = min(5.0, backoff * 2 or 0.2)
                    self._notice(f"cannot poll the coordinator for work ({e}); retrying in {backoff:.1f}s")
                    self._stop.wait(backoff)
                    continue
                backoff = 0.0
                for work in reply.assignments:
                    if work.job not in self._jobs:
                        self._notice(f"starting job {work.job!r}: {' '.join(work.argv)}")
                        self._start_job(work)
                for name in reply.cancelled:
                    job = self._jobs.get(name)
                    if job is not None:
                        self._notice(f"job {name!r} cancelled")
                        job.runner.request_stop(CANCELLED_EXIT_CODE, f"job {name!r} was cancelled")
        finally:
            self._done.set()

    def _reregister(self) -> bool:
        """The coordinator forgot this node (it restarted): register again; False if that fails."""
        try:
            node_id, hb = register(self._client, slots=self._config.slots, daemon=True)
        except (CoordinatorError, ValueError):
            return False
        self._hb.stop()
        self.node_id, self._hb = node_id, hb
        self._notice(f"the coordinator did not know this node any more; registered again as {node_id}")
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """True once the daemon stopped (after `stop`), False if `timeout` passed first."""
        return self._done.wait(timeout)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every running job's ranks, deregister the node and close the client (bounded)."""
        self._stop.set()
        self._notice(f"stopping node {self.node_id} ({len(self._jobs)} running jobs)")
        deadline = time.monotonic() + timeout
        for job in list(self._jobs.values()):
            job.runner.request_stop(CANCELLED_EXIT_CODE, "the worker daemon is stopping")
        for job in list(self._jobs.values()):
            job.thread.join(max(0.0, deadline - time.monotonic()))
        self._hb.stop()
        leave(self._client, self.node_id)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._done.set()


def start_daemon(conn: ConnectOptions, config: DaemonConfig, notice: Notice = _daemon_notice) -> RunningDaemon:
    """Register a daemon node and start polling for work; raises CoordinatorError if unreachable."""
    client, node_id, hb = connect_and_register(conn, slots=config.slots, daemon=True)
    notice(f"registered as node {node_id} with {config.slots} slots at {conn.address}")
    return RunningDaemon(client, conn, node_id, hb, config, notice)
