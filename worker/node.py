"""A node of `axond worker -- CMD`: register this host with the coordinator, keep its lease, run one job in a thread.

`start_agent` registers a node, starts its heartbeats and runs a `JobRunner` (`axond.worker.agent`) in a thread;
`register`, `connect_and_register` and `leave` are the node's registration, shared with the daemon.
"""

from __future__ import annotations

import socket
import threading
from typing import TYPE_CHECKING

from axond.errors import CoordinatorError
from axond.worker.agent import JobOutcome, JobRunner, Notice, stderr_notice
from axond.worker.heartbeat import Heartbeater
from axond.worker.launcher import OutputSink, print_sink
from axond.worker.progress import PROGRESS_EVERY_S
from axond.worker.spec import ConnectOptions, JobSpec

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient


class RunningAgent:
    """A registered node running one job in a thread; returned by `start_agent`."""

    def __init__(self, client: CoordinatorClient, node_id: str, heartbeater: Heartbeater, runner: JobRunner) -> None:
        self.node_id = node_id
        self._client = client
        self._hb = heartbeater
        self._runner = runner
        self._outcome: JobOutcome | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._main, name="axond-agent", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self._outcome = self._runner.run()
        except Exception as e:  # noqa: BLE001 - an unexpected bug must still end the agent with a message
            self._outcome = JobOutcome(1, f"agent error: {type(e).__name__}: {e}")
        finally:
            self._hb.stop()
            if self._outcome is not None and self._outcome.lease_lost:
                self._client.close()  # cut off or gone: the coordinator has declared the node dead already
            else:
                leave(self._client, self.node_id)
            self._done.set()

    def wait(self, timeout: float | None = None) -> JobOutcome | None:
        """The outcome once the job ended for this node, or None if `timeout` passed first."""
        self._done.wait(timeout)
        return self._outcome if self._done.is_set() else None

    def stop(self, exit_code: int, reason: str, timeout: float = 15.0) -> JobOutcome | None:
        """Stop the ranks and leave the job; the outcome carries `exit_code` unless it ended already."""
        self._runner.request_stop(exit_code, reason)
        if self._runner.joining.is_set():
            leave(self._client, self.node_id)
        return self.wait(timeout)


def register(client: CoordinatorClient, slots: int, daemon: bool,
             notice: Notice = stderr_notice) -> tuple[str, Heartbeater]:
    """Register this host as a node and start its heartbeat thread, which renews the node's lease
    (heartbeat interval x missed heartbeats, as the coordinator said)."""
    reply = client.register_node(socket.gethostname(), slots=slots, daemon=daemon)
    interval = reply.heartbeat_interval_s or 1.0
    lease = interval * (reply.dead_after_missed or 5)
    hb = Heartbeater(client, reply.node_id, interval, lease=lease, notice=notice).start()
    return reply.node_id, hb


def connect_and_register(conn: ConnectOptions, slots: int, daemon: bool,
                         notice: Notice = stderr_notice) -> tuple[CoordinatorClient, str, Heartbeater]:
    """Open a client and register this host with it; the client is closed again if registering fails."""
    client = conn.connect()
    try:
        node_id, hb = register(client, slots=slots, daemon=daemon, notice=notice)
    except BaseException:
        client.close()
        raise
    return client, node_id, hb


def leave(client: CoordinatorClient, node_id: str) -> None:
    """Deregister the node (best effort: the coordinator may be gone already) and close the client."""
    try:
        client.deregister_node(node_id)
    except (CoordinatorError, ValueError):
        pass
    client.close()


def start_agent(
    conn: ConnectOptions,
    spec: JobSpec,
    sink: OutputSink = print_sink,
    notice: Notice = stderr_notice,
    progress_every: float = PROGRESS_EVERY_S,
) -> RunningAgent:
    """Register a node, then run `spec` in a background thread; raises CoordinatorError if unreachable.
    While the rendezvous waits, a progress line goes to `notice` every `progress_every` seconds."""
    client, node_id, hb = connect_and_register(conn, slots=0, daemon=False, notice=notice)
    runner = JobRunner(client, conn, node_id, hb, spec, sink=sink, notice=notice, progress_every=progress_every)
    return RunningAgent(client, node_id, hb, runner)
