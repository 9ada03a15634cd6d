"""Heartbeats: the answer to one (shared by the unary call and the stream), and the per-node stream.

A node keeps one `HeartbeatStream` open and sends each heartbeat on it; every request is answered in
order exactly as the unary `Heartbeat` would answer it (durable answers after their group commit).
A domain error ends the stream with the unary call's status; the node opens a new stream. Liveness
is the heartbeats, not the stream: a node whose stream stays open but silent is declared dead
after the missed heartbeats like any other.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

from axond.coordinator.state.errors import InvalidArgument, StateError
from axond.coordinator.state.jobs import JobState
from axond.coordinator.persistence.group_commit import GroupCommit
from axond.coordinator.service.stall import StallWatch
from axond.coordinator.state.machine import CoordinatorState
from axond.coordinator.service.status_codes import Undecodable, refuse, status_of
from axond.v1 import coordinator_pb2 as pb

log = logging.getLogger("axond.coordinator")

JOB_STATE_PB: dict[JobState, pb.JobState] = {
    JobState.PENDING: pb.JOB_STATE_PENDING,
    JobState.RUNNING: pb.JOB_STATE_RUNNING,
    JobState.RESTARTING: pb.JOB_STATE_RESTARTING,
    JobState.SUCCEEDED: pb.JOB_STATE_SUCCEEDED,
    JobState.FAILED: pb.JOB_STATE_FAILED,
    JobState.CANCELLED: pb.JOB_STATE_CANCELLED,
}


def job_state_pb(state: JobState | None) -> pb.JobState:
    return JOB_STATE_PB[state] if state is not None else pb.JOB_STATE_UNSPECIFIED


def heartbeat_reply(state: CoordinatorState, request: pb.HeartbeatRequest,
                    stalls: StallWatch | None = None) -> pb.HeartbeatResponse:
    """Renew the node's lease and tell it its job's generation and the interval to beat at (a heartbeat answered
    just after a stall of the coordinator renews nothing: see stall.py)."""
    state.authenticate(request.node_id, request.node_secret)
    now = time.monotonic()
    renew = stalls is None or stalls.renews(now)
    r = state.heartbeat(request.node_id, request.job, request.generation, now, tuple(request.local_pids), renew)
    return pb.HeartbeatResponse(generation=r.generation, job_state=job_state_pb(r.state), reason=r.reason,
                                heartbeat_interval_s=r.interval, live=r.live)


async def serve_heartbeats(state: CoordinatorState, commits: GroupCommit | None, requests: AsyncIterator[Any],
                           context: grpc.aio.ServicerContext[Any, Any],
                           stalls: StallWatch | None = None) -> AsyncIterator[pb.HeartbeatResponse]:
    """Answer each heartbeat of the stream in order; a domain error ends the stream with its status."""
    try:
        async for request in requests:
            if isinstance(request, Undecodable):
                raise InvalidArgument(f"a HeartbeatStream request does not parse: {request.error[:200]}")
            if commits is not None and (commits.pending_calls >= commits.max_batch or commits.failed is not None):
                await commits.room()
            try:
                reply = heartbeat_reply(state, request, stalls)
            finally:
                if commits is not None and (commits.needed > commits.committed or commits.failed is not None):
                    await commits.durable()
            yield reply
    except StateError as e:
        code, text = status_of(e)  # type: ignore[misc]
        refuse(context, code, text)
    except Exception as e:
        if isinstance(e, grpc.aio.AbortError):
            raise
        log.exception("HeartbeatStream failed")
        refuse(context, grpc.StatusCode.INTERNAL, f"coordinator error in HeartbeatStream: {e!r}")
