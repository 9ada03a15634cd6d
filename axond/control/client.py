"""The coordinator client: typed wrappers over the generated stub with deadlines, retries and clear errors.

Every call carries a deadline. Long-polls (join, store waits, barrier, poll_work) ask the server to
wait at most the caller's timeout and give the RPC that timeout plus `call_timeout`. Calls that are
safe to repeat are retried briefly (bounded) when the coordinator is UNAVAILABLE.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from axond.config import RuntimeEnv
from axond.control.channel import DEFAULT_CONNECT_TIMEOUT_S, normalize_address, open_channel, split_addresses
from axond.control.credentials import LocalToken, token_source
from axond.control.errors import not_grpc, translate
from axond.control.replicas import Replicas
from axond.control.sniff import speaks_tls
from axond.errors import CoordinatorError
from axond.store import coordinator as coordinator_store  # the module: it imports this one's package back
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc

R = TypeVar("R")

STREAM_RECONNECT_S = 60.0
"""Seconds a job's event stream is opened again after the coordinator went away (as long as workers ride it out)."""
RETRY_BACKOFF_S = (0.1, 0.3, 0.9)
"""Sleeps between attempts of an idempotent call that found the coordinator UNAVAILABLE."""
BUSY_BACKOFF_S = (0.05, 1.6)
"""First and largest upper bound of the jittered, doubling sleeps between attempts of a call the coordinator
turned away as busy; it is sent again until its deadline."""


def _busy(e: grpc.RpcError) -> bool:
    """Whether the coordinator refused the call for load (admission control), not for what it asked."""
    return bool(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Concurrent RPC limit" in (e.details() or ""))


def _never_ran(e: grpc.RpcError) -> bool:
    """Whether the call surely did not run: nothing listened, or a follower replica turned it away."""
    details = (e.details() or "").lower()
    return ("is a follower" in details or "no longer the leader" in details
            or any(text in details for text in _NOT_LISTENING_YET))


DEFAULT_CONNECT_WAIT_S = 30.0
"""How long the CLI waits for a coordinator that is not reachable yet (it may be starting)."""

_NOT_LISTENING_YET = ("connection refused", "errors resolving", "dns resolution failed", "domain name not found",
                      "name or service not known", "no route to host", "network is unreachable",
                      "failed to connect to all addresses")
"""UNAVAILABLE details meaning the request never reached a server (safe to send again, even if not idempotent):
gRPC says "failed to connect to all addresses" for every connection attempt that failed (refused, timed
out, reset during the handshake) before it sent anything."""
_MISCONFIGURED = ("handshake failed", "ssl_error", "certificate")
"""Connect failures that waiting does not mend (TLS set up differently on the two ends): reported at once."""


def _non_negative(**counts: int) -> None:
    for name, value in counts.items():
        if value < 0:
            raise CoordinatorError(f"{name} is {value}; it must be >= 0")


class CoordinatorClient:
    """A connection to one coordinator, or to its replicas (`H1:P1,H2:P2`: calls go to the leader, found
    through the followers' redirects, and move on when it fails). Thread-safe (gRPC channels are)."""

    def __init__(
        self, address: str, token: str | LocalToken | None = None, tls_ca: str | None = None, call_timeout: float = 10.0,
        tls_cert: str | None = None, tls_key: str | None = None,
        connect_wait: float = 0.0, on_wait: Callable[[str], None] | None = None,
    ) -> None:
        """`connect_wait`: until a first call got through, calls that could not connect to `address` (nothing
        listening yet, a handshake cut short or timed out) are sent again for up to this many seconds (the
        coordinator may still be starting, the link may be slow); it also bounds each connection attempt.
        `on_wait` receives one line saying so when that wait begins."""
        if not call_timeout > 0:
            raise CoordinatorError(f"call_timeout is {call_timeout}; it must be > 0 seconds")
        if not connect_wait >= 0:
            raise CoordinatorError(f"connect_wait is {connect_wait}; it must be >= 0 seconds")
        self.address = normalize_address(address)
        self.addresses = split_addresses(self.address)
        """Every replica's address (one for a single coordinator)."""
        self.call_timeout = call_timeout
        self._token = token
        self.connect_wait = connect_wait
        self.connect_timeout = connect_wait if connect_wait > 0 else DEFAULT_CONNECT_TIMEOUT_S
        """How long one connection attempt (TCP, TLS and HTTP/2 handshakes) may take: the connect wait, or
        gRPC's default when there is none; never the reconnect backoff (slow links need whole round trips)."""
        self._on_wait = on_wait
        self._reached = False
        self._wait_until: float | None = None
        self._wait_lock = threading.Lock()
        self._backoff = 0.05
        self._tls = bool(tls_ca)
        self._sniffed: bool | None = None
        self._replicas: Replicas | None = None
        if len(self.addresses) > 1:
            self._replicas = Replicas([open_channel(a, token, tls_ca, tls_cert, tls_key, self.connect_timeout)
                                       for a in self.addresses], self.addresses)
            self._channel = self._replicas.channels[0]
            self.stub: Any = self._replicas.stub
            self._health: Any = self._replicas.health
        else:
            self._channel = open_channel(self.address, token, tls_ca, tls_cert, tls_key, self.connect_timeout)
            self.stub = pb_grpc.CoordinatorStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        self._node_secrets: dict[str, str] = {}

    @property
    def token(self) -> str | None:
        """The token this client sends (None: none, or a local coordinator's token not written yet)."""
        return self._token() if isinstance(self._token, LocalToken) else self._token

    @property
    def reached(self) -> bool:
        """Whether a call has got through to the coordinator (until then calls honour `connect_wait`)."""
        return self._reached

    @property
    def active_address(self) -> str:
        """Where calls go now (with several replicas: the leader, as far as this client knows)."""
        return self._replicas.active_address if self._replicas is not None else self.address

    def node_secret(self, node_id: str) -> str:
        """The secret RegisterNode gave `node_id` through this client ("" if it did not)."""
        return self._node_secrets.get(node_id, "")

    def adopt_node(self, node_id: str, secret: str) -> None:
        """Act as `node_id` (registered through another client) in node-scoped calls."""
        self._node_secrets[node_id] = secret

    def call(
        self,
        op: str,
        method: Callable[..., R],
        request: Any,
        wait: float = 0.0,
        retry: bool = False,
        store: bool = False,
        call_timeout: float | None = None,
    ) -> R:
        """Invoke `method` with a deadline of `wait + call_timeout` (the client's unless given); translate failures."""
        limit = self.call_timeout if call_timeout is None else call_timeout
        deadline = time.monotonic() + wait + limit
        attempt = 0
        while True:
            try:
                reply = method(request, timeout=max(0.001, deadline - time.monotonic()))
                self._reached = True
                if self._replicas is not None:
                    self._replicas.answered()
                return reply
            except grpc.RpcError as e:
                if self._replicas is not None and e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    # CANCELLED: a replica stopping (cleanly) cut the call short
                    pause = self._replicas.fail_over(e, retry or _never_ran(e))
                    if pause is not None and time.monotonic() + pause < deadline:
                        time.sleep(pause)
                        continue
                if self._wait_for_start(e, retry):
                    deadline = time.monotonic() + wait + limit
                    continue
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    self._reached = True
                if retry and e.code() == grpc.StatusCode.UNAVAILABLE and not not_grpc(e):
                    pause = RETRY_BACKOFF_S[attempt] if attempt < len(RETRY_BACKOFF_S) else None
                elif _busy(e):  # every call may retry: a refused call did not run
                    first, largest = BUSY_BACKOFF_S
                    pause = random.uniform(0, min(largest, first * 2 ** min(attempt, 16)))
                else:
                    pause = None
                if pause is not None and time.monotonic() + pause < deadline:
                    time.sleep(pause)
                    attempt += 1
                    continue
                if self._sniffed:
                    raise CoordinatorError(
                        f"{op} at coordinator {self.address} failed: it serves TLS and this client speaks plaintext; "
                        "pass --tls-ca CA.pem (or set AXOND_TLS_CA) with the CA that signed its certificate"
                    ) from e
                raise translate(op, self.address, e, store=store) from e

    def _wait_for_start(self, e: grpc.RpcError, retry: bool) -> bool:
        """Before the first call got through: sleep (backing off) and return True if `e` is a transient
        connect failure and the connect wait has time left. Any UNAVAILABLE is one for a call safe to
        repeat (`retry`); for others only a failure that surely sent nothing (nothing listening, a
        connection attempt that failed)."""
        if self._reached or self.connect_wait <= 0 or e.code() != grpc.StatusCode.UNAVAILABLE:
            return False
        details = (e.details() or "").lower()
        if not retry and not any(text in details for text in _NOT_LISTENING_YET):
            return False
        if any(text in details for text in _MISCONFIGURED) or not_grpc(e):
            return False
        if "socket closed" in details and not self._tls and self._serves_tls():
            return False  # a TLS coordinator closing on a plaintext client: say so now (pass --tls-ca)
        now = time.monotonic()
        with self._wait_lock:
            if self._wait_until is None:
                self._wait_until = now + self.connect_wait
                if self._on_wait is not None:
                    self._on_wait(
                        f"waiting for the coordinator at {self.address} (not reachable yet; up to {self.connect_wait:g} s)"
                    )
            left = self._wait_until - now
        if left <= 0:
            return False
        self._backoff = min(0.5, self._backoff * 2)
        time.sleep(min(self._backoff, left))
        return True

    def _serves_tls(self) -> bool:
        """Whether the coordinator answers TLS (asked once, for a plaintext client whose connections are closed)."""
        if self._sniffed is None:
            self._sniffed = speaks_tls(self.active_address, timeout=2.0)
        return self._sniffed

    def register_node(self, hostname: str, slots: int = 0, daemon: bool = False) -> pb.RegisterNodeResponse:
        _non_negative(slots=slots)
        req = pb.RegisterNodeRequest(hostname=hostname, slots=slots, daemon=daemon)
        reply = self.call("RegisterNode", self.stub.RegisterNode, req)
        self._node_secrets[reply.node_id] = reply.node_secret
        return reply

    def heartbeat(
        self, node_id: str, job: str = "", generation: int = 0, local_pids: Sequence[int] = (),
        timeout: float | None = None,
    ) -> pb.HeartbeatResponse:
        """Renew the node's liveness; `local_pids` (pid of each local rank, 0 if not running) feed status."""
        _non_negative(generation=generation)
        req = pb.HeartbeatRequest(
            node_id=node_id, job=job, generation=generation, node_secret=self.node_secret(node_id),
            local_pids=list(local_pids),
        )
        return self.call("Heartbeat", self.stub.Heartbeat, req, retry=True, call_timeout=timeout)

    def deregister_node(self, node_id: str) -> None:
        self.call("DeregisterNode", self.stub.DeregisterNode, pb.DeregisterNodeRequest(node_id=node_id, node_secret=self.node_secret(node_id)), retry=True)

    def join(
        self, job: str, node_id: str, nproc: int, min_nodes: int, max_nodes: int, max_restarts: int = 0,
        timeout: float = 300.0, live_recovery: bool = False,
    ) -> pb.JoinResponse:
        """Wait (up to `timeout` s) for the job's rendezvous to freeze; returns this node's ranks (`live_recovery`: the
        job re-forms around a failed node without restarting the others' ranks)."""
        _non_negative(nproc=nproc, min_nodes=min_nodes, max_nodes=max_nodes, max_restarts=max_restarts)
        req = pb.JoinRequest(
            job=job, node_id=node_id, nproc=nproc, min_nodes=min_nodes, max_nodes=max_nodes,
            max_restarts=max_restarts, timeout_s=timeout, node_secret=self.node_secret(node_id),
            live_recovery=live_recovery,
        )
        return self.call("Join", self.stub.Join, req, wait=timeout, retry=True)

    def report_failure(
        self, job: str, node_id: str, generation: int, rank: int, exit_code: int, message: str,
        unreachable: Sequence[int] = (),
    ) -> pb.ReportFailureResponse:
        """A rank (or the agent, `rank` -1) failed; `unreachable`: instead, this node's ranks run but cannot reach
        these node ranks of `generation` (a live job's cut link: the coordinator decides who leaves)."""
        req = pb.ReportFailureRequest(
            job=job, node_id=node_id, generation=generation, rank=rank, exit_code=exit_code, message=message,
            node_secret=self.node_secret(node_id), unreachable=list(unreachable),
        )
        return self.call("ReportFailure", self.stub.ReportFailure, req, retry=True)

    def report_exit(self, job: str, node_id: str, generation: int, exit_code: int) -> None:
        req = pb.ReportExitRequest(
            job=job, node_id=node_id, generation=generation, exit_code=exit_code, node_secret=self.node_secret(node_id)
        )
        self.call("ReportExit", self.stub.ReportExit, req, retry=True)

    def submit_job(
        self, argv: list[str], nnodes: int, nproc_per_node: int, job: str = "",
        env: dict[str, str] | None = None, max_restarts: int = 0, cwd: str = "",
        min_nodes: int = 0, live_recovery: bool = False,
    ) -> str:
        """Queue a job for the worker daemons; returns its name (`min_nodes`, with `live_recovery`: the job goes on
        while at least that many of its `nnodes` are left; 0: all of them)."""
        _non_negative(nnodes=nnodes, nproc_per_node=nproc_per_node, max_restarts=max_restarts, min_nodes=min_nodes)
        req = pb.SubmitJobRequest(
            job=job, nnodes=nnodes, nproc_per_node=nproc_per_node, argv=argv, env=env or {},
            max_restarts=max_restarts, cwd=cwd, min_nodes=min_nodes, live_recovery=live_recovery,
        )
        return self.call("SubmitJob", self.stub.SubmitJob, req).job

    def poll_work(self, node_id: str, wait_s: float) -> pb.PollWorkResponse:
        """Daemon long-poll: new assignments and cancellations (each delivered once)."""
        req = pb.PollWorkRequest(node_id=node_id, wait_s=wait_s, node_secret=self.node_secret(node_id))
        return self.call("PollWork", self.stub.PollWork, req, wait=wait_s)

    def push_output(self, job: str, node_id: str, lines: list[pb.OutputLine]) -> None:
        req = pb.PushOutputRequest(job=job, node_id=node_id, lines=lines, node_secret=self.node_secret(node_id))
        self.call("PushOutput", self.stub.PushOutput, req)

    def stream_job(self, job: str, timeout: float | None = None,
                   reconnect_for: float = STREAM_RECONNECT_S) -> Iterator[pb.JobEvent]:
        """The job's events from its start until JobFinished.

        With `timeout=None` the stream has no deadline (jobs run for hours); channel keepalives
        still detect a dead coordinator within ~15 s. A stream that was delivering events and breaks
        because the coordinator went away (restarted, failing over) is opened again for up to
        `reconnect_for` seconds, the events already delivered skipped (the coordinator keeps them).
        """
        delivered = 0
        lost_at: float | None = None
        while True:
            call = self.stub.StreamJob(pb.StreamJobRequest(job=job), timeout=timeout)
            seen = 0
            try:
                for event in call:
                    seen += 1
                    if seen <= delivered:
                        continue
                    delivered, lost_at = seen, None
                    yield event
                return
            except grpc.RpcError as e:
                now = time.monotonic()
                gone = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) and delivered > 0
                lost_at = lost_at if lost_at is not None else now
                if not gone or now - lost_at > reconnect_for:
                    raise translate("StreamJob", self.address, e) from e
                time.sleep(0.5)
            finally:
                call.cancel()

    def cancel_job(self, job: str) -> None:
        self.call("CancelJob", self.stub.CancelJob, pb.CancelJobRequest(job=job), retry=True)

    def get_status(self, job: str = "", all: bool = False, max_ranks: int = 0) -> pb.GetStatusResponse:
        """Nodes and jobs; `all` includes finished jobs and dead nodes past the retention time."""
        _non_negative(max_ranks=max_ranks)
        req = pb.GetStatusRequest(job=job, all=all, max_ranks=max_ranks)
        return self.call("GetStatus", self.stub.GetStatus, req, retry=True)

    def health(self, timeout: float = 5.0) -> bool:
        """The standard grpc.health.v1 check: True if the coordinator answers SERVING."""
        try:
            return self.check_health(timeout) == health_pb2.HealthCheckResponse.SERVING
        except CoordinatorError:
            return False

    def check_health(self, timeout: float = 5.0) -> int:
        """The grpc.health.v1 status the coordinator answers (`HealthCheckResponse.SERVING` when it serves);
        raises CoordinatorError if it cannot be asked (unreachable, TLS mismatch)."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as e:
            raise translate("Check (grpc.health.v1)", self.address, e) from e
        return int(resp.status)

    def store(self, job: str, generation: int) -> coordinator_store.CoordinatorStore:
        """The KV store of one job generation, served by this coordinator."""
        return coordinator_store.CoordinatorStore(self, job, generation)

    def close(self) -> None:
        if self._replicas is not None:
            self._replicas.close()
        else:
            self._channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    address: str | None = None, token: str | None = None, tls_ca: str | None = None, call_timeout: float = 10.0,
    *, token_file: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
    connect_wait: float = 0.0, on_wait: Callable[[str], None] | None = None, env: RuntimeEnv | None = None,
) -> CoordinatorClient:
    """A client for the coordinator at `address` (else AXOND_COORDINATOR).

    The token comes from `token`, `token_file`, AXOND_TOKEN_FILE, AXOND_TOKEN or, for a coordinator on
    this machine, the default state directory (see axond.control.credentials); the CA and the client
    certificate (mutual TLS) from AXOND_TLS_CA, AXOND_TLS_CERT and AXOND_TLS_KEY when not given. The variables
    are those of `env` (default: this process's environment, read now).
    """
    env = env if env is not None else RuntimeEnv.from_env()
    address = address or env.coordinator
    if not address:
        raise CoordinatorError("no coordinator address: pass --coordinator HOST:PORT or set AXOND_COORDINATOR")
    address = normalize_address(address)
    source = token_source(address, token, token_file, env)
    tls_ca = tls_ca or env.tls_ca
    tls_cert = tls_cert or env.tls_cert
    tls_key = tls_key or env.tls_key
    return CoordinatorClient(
        address, source, tls_ca, call_timeout, tls_cert, tls_key, connect_wait=connect_wait, on_wait=on_wait
    )
