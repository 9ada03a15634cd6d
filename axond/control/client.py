"""The coordinator client: typed wrappers over the generated stub with deadlines, retries and clear errors.

Every call carries a deadline. Long-polls (join, store waits, barrier, poll_work) ask the server to
wait at most the caller's timeout and give the RPC that timeout plus `call_timeout`. Calls that are
safe to repeat are retried briefly (bounded) when the coordinator is UNAVAILABLE.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from axond.control.channel import normalize_address, open_channel
from axond.control.errors import translate
from axond.control.store import CoordinatorStore
from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc

R = TypeVar("R")

RETRY_BACKOFF_S = (0.1, 0.3, 0.9)
"""Sleeps between attempts of an idempotent call that found the coordinator UNAVAILABLE."""


def _non_negative(**counts: int) -> None:
    for name, value in counts.items():
        if value < 0:
            raise CoordinatorError(f"{name} is {value}; it must be >= 0")


class CoordinatorClient:
    """A connection to one coordinator. Thread-safe (gRPC channels are)."""

    def __init__(self, address: str, token: str | None = None, tls_ca: str | None = None, call_timeout: float = 10.0) -> None:
        if not call_timeout > 0:
            raise CoordinatorError(f"call_timeout is {call_timeout}; it must be > 0 seconds")
        self.address = normalize_address(address)
        self.call_timeout = call_timeout
        self._channel = open_channel(self.address, token, tls_ca)
        self.stub = pb_grpc.CoordinatorStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def call(
        self,
        op: str,
        method: Callable[..., R],
        request: Any,
        wait: float = 0.0,
        retry: bool = False,
        store: bool = False,
    ) -> R:
        """Invoke `method` with a deadline of `wait + call_timeout`; translate failures."""
        deadline = time.monotonic() + wait + self.call_timeout
        attempt = 0
        while True:
            try:
                return method(request, timeout=max(0.001, deadline - time.monotonic()))
            except grpc.RpcError as e:
                if (
                    retry
                    and e.code() == grpc.StatusCode.UNAVAILABLE
                    and attempt < len(RETRY_BACKOFF_S)
                    and time.monotonic() + RETRY_BACKOFF_S[attempt] < deadline
                ):
                    time.sleep(RETRY_BACKOFF_S[attempt])
                    attempt += 1
                    continue
                raise translate(op, self.address, e, store=store) from e

    def register_node(self, hostname: str, slots: int = 0, daemon: bool = False) -> pb.RegisterNodeResponse:
        _non_negative(slots=slots)
        req = pb.RegisterNodeRequest(hostname=hostname, slots=slots, daemon=daemon)
        return self.call("RegisterNode", self.stub.RegisterNode, req)

    def heartbeat(self, node_id: str, job: str = "", generation: int = 0) -> pb.HeartbeatResponse:
        _non_negative(generation=generation)
        req = pb.HeartbeatRequest(node_id=node_id, job=job, generation=generation)
        return self.call("Heartbeat", self.stub.Heartbeat, req, retry=True)

    def deregister_node(self, node_id: str) -> None:
        self.call("DeregisterNode", self.stub.DeregisterNode, pb.DeregisterNodeRequest(node_id=node_id), retry=True)

    def join(
        self, job: str, node_id: str, nproc: int, min_nodes: int, max_nodes: int, max_restarts: int = 0,
        timeout: float = 300.0,
    ) -> pb.JoinResponse:
        """Wait (up to `timeout` s) for the job's rendezvous to freeze; returns this node's ranks."""
        _non_negative(nproc=nproc, min_nodes=min_nodes, max_nodes=max_nodes, max_restarts=max_restarts)
        req = pb.JoinRequest(
            job=job, node_id=node_id, nproc=nproc, min_nodes=min_nodes, max_nodes=max_nodes,
            max_restarts=max_restarts, timeout_s=timeout,
        )
        return self.call("Join", self.stub.Join, req, wait=timeout, retry=True)

    def report_failure(
        self, job: str, node_id: str, generation: int, rank: int, exit_code: int, message: str
    ) -> pb.ReportFailureResponse:
        req = pb.ReportFailureRequest(
            job=job, node_id=node_id, generation=generation, rank=rank, exit_code=exit_code, message=message
        )
        return self.call("ReportFailure", self.stub.ReportFailure, req, retry=True)

    def report_exit(self, job: str, node_id: str, generation: int, exit_code: int) -> None:
        req = pb.ReportExitRequest(job=job, node_id=node_id, generation=generation, exit_code=exit_code)
        self.call("ReportExit", self.stub.ReportExit, req, retry=True)

    def submit_job(
        self, argv: list[str], nnodes: int, nproc_per_node: int, job: str = "",
        env: dict[str, str] | None = None, max_restarts: int = 0, cwd: str = "",
    ) -> str:
        """Queue a job for the worker daemons; returns its name."""
        _non_negative(nnodes=nnodes, nproc_per_node=nproc_per_node, max_restarts=max_restarts)
        req = pb.SubmitJobRequest(
            job=job, nnodes=nnodes, nproc_per_node=nproc_per_node, argv=argv, env=env or {},
            max_restarts=max_restarts, cwd=cwd,
        )
        return self.call("SubmitJob", self.stub.SubmitJob, req).job

    def poll_work(self, node_id: str, wait_s: float) -> pb.PollWorkResponse:
        """Daemon long-poll: new assignments and cancellations (each delivered once)."""
        return self.call("PollWork", self.stub.PollWork, pb.PollWorkRequest(node_id=node_id, wait_s=wait_s), wait=wait_s)

    def push_output(self, job: str, node_id: str, lines: list[pb.OutputLine]) -> None:
        self.call("PushOutput", self.stub.PushOutput, pb.PushOutputRequest(job=job, node_id=node_id, lines=lines))

    def stream_job(self, job: str, timeout: float | None = None) -> Iterator[pb.JobEvent]:
        """The job's events from its start until JobFinished.

        With `timeout=None` the stream has no deadline (jobs run for hours); channel keepalives
        still detect a dead coordinator within ~15 s.
        """
        call = self.stub.StreamJob(pb.StreamJobRequest(job=job), timeout=timeout)
        try:
            for event in call:
                yield event
        except grpc.RpcError as e:
            raise translate("StreamJob", self.address, e) from e
        finally:
            call.cancel()

    def cancel_job(self, job: str) -> None:
        self.call("CancelJob", self.stub.CancelJob, pb.CancelJobRequest(job=job), retry=True)

    def get_status(self, job: str = "") -> pb.GetStatusResponse:
        return self.call("GetStatus", self.stub.GetStatus, pb.GetStatusRequest(job=job), retry=True)

    def health(self, timeout: float = 5.0) -> bool:
        """The standard grpc.health.v1 check: True if the coordinator answers SERVING."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    def store(self, job: str, generation: int) -> CoordinatorStore:
        """The KV store of one job generation, served by this coordinator."""
        return CoordinatorStore(self, job, generation)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    address: str | None = None, token: str | None = None, tls_ca: str | None = None, call_timeout: float = 10.0
) -> CoordinatorClient:
    """A client for the coordinator at `address` (else $AXOND_COORDINATOR), token and CA from the env too."""
    address = address or os.environ.get("AXOND_COORDINATOR", "")
    if not address:
        raise CoordinatorError("no coordinator address: pass --coordinator HOST:PORT or set AXOND_COORDINATOR")
    token = token or os.environ.get("AXOND_TOKEN") or None
    tls_ca = tls_ca or os.environ.get("AXOND_TLS_CA") or None
    return CoordinatorClient(address, token, tls_ca, call_timeout)
