"""The Coordinator gRPC servicer: proto -> CoordinatorState call -> proto, errors -> status codes.

Waiting RPCs (Join, KvGet with wait, KvWait, Barrier, PollWork, StreamJob) are coroutines parked
on a `WaitHub`, so thousands of waiters cost no threads. Every wait is bounded by the request's
own wait and by the call's deadline. With a durable state every answer (errors included) waits
for the group commit of everything the state had changed when it was computed (`GroupCommit`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

import grpc
import grpc.aio

from axond.coordinator.state.errors import InvalidArgument, StateError, check_wait
from axond.coordinator.service.heartbeat_stream import heartbeat_reply, job_state_pb, serve_heartbeats
from axond.coordinator.state.jobs import FinishedEvent, InfoEvent, JobSpec, OutputEvent
from axond.coordinator.service.kv_calls import KvCalls, WaitExpired, bounded
from axond.coordinator.service.kv_stream import KvStreamHandler
from axond.coordinator.persistence.group_commit import GroupCommit
from axond.coordinator.service.stall import StallWatch
from axond.coordinator.state.machine import CoordinatorState
from axond.coordinator.service.status_codes import STATUS_OF, Undecodable, refuse, status_of
from axond.coordinator.service.waiting import WaitHub
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger("axond.coordinator")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[["CoordinatorServicer", Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]]


def _check_decoded(request: Any) -> None:
    if isinstance(request, Undecodable):
        raise InvalidArgument(f"the {request.method} request body does not parse: {request.error[:200]}")


def _translated(fn: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Map domain exceptions to status codes; anything unexpected becomes INTERNAL, never a crash. A refused call
    sets its status and returns (`refuse`): nothing raised keeps its request."""

    @functools.wraps(fn)
    async def wrapper(self: CoordinatorServicer, request: Req, context: grpc.aio.ServicerContext[Any, Any]) -> Resp:
        commits = self.commits
        try:
            _check_decoded(request)
            if commits is None:
                return await fn(self, request, context)
            if commits.pending_calls >= commits.max_batch or commits.failed is not None:
                await commits.room()
            try:
                reply = await fn(self, request, context)
            except (StateError, WaitExpired):
                await commits.durable()
                raise
            if commits.needed > commits.committed or commits.failed is not None:
                await commits.durable()
            return reply
        except (StateError, WaitExpired) as e:
            code, text = status_of(e)  # type: ignore[misc]
            refuse(context, code, text)
        except Exception as e:
            log.exception("%s failed", fn.__name__)
            refuse(context, grpc.StatusCode.INTERNAL, f"coordinator error in {fn.__name__}: {e!r}")
        return None  # type: ignore[return-value]  # (the status set above goes out; gRPC sends no message)

    return wrapper


def _event_pb(event: OutputEvent | InfoEvent | FinishedEvent) -> pb.JobEvent:
    if isinstance(event, OutputEvent):
        return pb.JobEvent(output=pb.OutputLine(rank=event.rank, stream=event.stream, text=event.text))
    if isinstance(event, InfoEvent):
        return pb.JobEvent(info=event.text)
    return pb.JobEvent(finished=pb.JobFinished(exit_code=event.exit_code, message=event.message))


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Thin translation layer over `CoordinatorState`."""

    def __init__(self, state: CoordinatorState, hub: WaitHub, commits: GroupCommit | None = None,
                 stalls: StallWatch | None = None) -> None:
        """`commits`: the durable state's group committer (None: in memory, answers leave at once); `stalls`:
        the server's stall detector (heartbeats just after a stall renew no lease)."""
        self.state = state
        self.stalls = stalls
        self.hub = hub
        self.commits = commits
        self.kv = KvCalls(state, hub)
        self.kv_stream = KvStreamHandler(self.kv, commits, idle_s=state.limits.stream_idle_s)

    @_translated
    async def RegisterNode(self, request: pb.RegisterNodeRequest, context: Any) -> pb.RegisterNodeResponse:
        node = self.state.register_node(request.hostname, request.slots, request.daemon, time.monotonic())
        live = self.state.members.liveness
        return pb.RegisterNodeResponse(
            node_id=node.node_id,
            node_secret=node.secret,
            heartbeat_interval_s=node.interval or live.heartbeat_interval,
            dead_after_missed=live.dead_after_missed,
        )

    @_translated
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        return heartbeat_reply(self.state, request, self.stalls)

    @_translated
    async def DeregisterNode(self, request: pb.DeregisterNodeRequest, context: Any) -> pb.DeregisterNodeResponse:
        self.state.authenticate(request.node_id, request.node_secret)
        self.state.deregister_node(request.node_id, time.monotonic())
        return pb.DeregisterNodeResponse()

    @_translated
    async def Join(self, request: pb.JoinRequest, context: Any) -> pb.JoinResponse:
        timeout = check_wait("timeout_s", request.timeout_s, allow_zero=False)
        self.state.authenticate(request.node_id, request.node_secret)
        job, node = request.job, request.node_id
        got = self.state.join(
            job, node, request.nproc, request.min_nodes, request.max_nodes, request.max_restarts, time.monotonic(),
            request.live_recovery,
        )
        if got is None:
            since = self.state.jobs[job].generation
            try:
                got = await self.hub.until(
                    bounded(timeout, context.time_remaining()),
                    lambda: self.state.join_result(job, node, time.monotonic(), since),
                    lambda: [("job", job)],
                )
            except BaseException:
                self.state.leave_rendezvous(job, node)
                raise
            if got is None:
                progress = self.state.rendezvous_progress(job)
                self.state.leave_rendezvous(job, node)
                raise WaitExpired(
                    f"rendezvous of job {job!r} did not complete within {timeout:g} s "
                    f"({progress}); start the missing workers or lower --nnodes"
                )
        return pb.JoinResponse(
            generation=got.generation,
            node_rank=got.node_rank,
            nnodes=got.nnodes,
            rank_offset=got.rank_offset,
            world_size=got.world_size,
            local_world_size=got.local_world_size,
            job_secret=got.job_secret,
            restarts_left=got.restarts_left,
        )

    @_translated
    async def ReportFailure(self, request: pb.ReportFailureRequest, context: Any) -> pb.ReportFailureResponse:
        self.state.authenticate(request.node_id, request.node_secret)
        generation, will = self.state.report_failure(
            request.job, request.node_id, request.generation, request.rank, request.exit_code, request.message,
            time.monotonic(), list(request.unreachable),
        )
        left = self.state.left_job(request.job, request.node_id)
        return pb.ReportFailureResponse(generation=generation, will_restart=will and not left, left_job=left)

    @_translated
    async def ReportExit(self, request: pb.ReportExitRequest, context: Any) -> pb.ReportExitResponse:
        self.state.authenticate(request.node_id, request.node_secret)
        self.state.report_exit(request.job, request.node_id, request.generation, request.exit_code, time.monotonic())
        return pb.ReportExitResponse()

    @_translated
    async def KvSet(self, request: pb.KvSetRequest, context: Any) -> pb.KvSetResponse:
        return await self.kv.set(request, context.time_remaining())

    @_translated
    async def KvGet(self, request: pb.KvGetRequest, context: Any) -> pb.KvGetResponse:
        return await self.kv.get(request, context.time_remaining())

    @_translated
    async def KvAdd(self, request: pb.KvAddRequest, context: Any) -> pb.KvAddResponse:
        return await self.kv.add(request, context.time_remaining())

    @_translated
    async def KvCompareAndSet(self, request: pb.KvCompareAndSetRequest, context: Any) -> pb.KvCompareAndSetResponse:
        return await self.kv.compare_set(request, context.time_remaining())

    @_translated
    async def KvDelete(self, request: pb.KvDeleteRequest, context: Any) -> pb.KvDeleteResponse:
        return await self.kv.delete(request, context.time_remaining())

    @_translated
    async def KvWait(self, request: pb.KvWaitRequest, context: Any) -> pb.KvWaitResponse:
        return await self.kv.wait(request, context.time_remaining())

    @_translated
    async def Barrier(self, request: pb.BarrierRequest, context: Any) -> pb.BarrierResponse:
        return await self.kv.barrier(request, context.time_remaining())

    async def KvStream(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
                       ) -> AsyncIterator[pb.KvStreamResponse]:
        """The KV calls over one stream (see kv_stream.py)."""
        async for response in self.kv_stream.serve(requests, context):
            yield response

    async def HeartbeatStream(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
                              ) -> AsyncIterator[pb.HeartbeatResponse]:
        """Heartbeats over one stream per node (see heartbeat_stream.py)."""
        async for response in serve_heartbeats(self.state, self.commits, requests, context, self.stalls):
            yield response

    @_translated
    async def SubmitJob(self, request: pb.SubmitJobRequest, context: Any) -> pb.SubmitJobResponse:
        spec = JobSpec(
            nnodes=request.nnodes,
            nproc_per_node=request.nproc_per_node,
            argv=tuple(request.argv),
            env=tuple(sorted(request.env.items())),
            max_restarts=request.max_restarts,
            cwd=request.cwd,
            min_nodes=request.min_nodes,
            live_recovery=request.live_recovery,
        )
        return pb.SubmitJobResponse(job=self.state.submit_job(request.job, spec, time.monotonic()))

    @_translated
    async def PollWork(self, request: pb.PollWorkRequest, context: Any) -> pb.PollWorkResponse:
        wait_s = check_wait("wait_s", request.wait_s)
        self.state.authenticate(request.node_id, request.node_secret)
        node = request.node_id

        def take() -> tuple[list[tuple[str, JobSpec]], list[str]] | None:
            work, cancelled = self.state.take_work(node, time.monotonic())
            return (work, cancelled) if work or cancelled else None

        got = take()
        if got is None and wait_s > 0:
            got = await self.hub.until(bounded(wait_s, context.time_remaining()), take, lambda: [("work", node)])
        work, cancelled = got or ([], [])
        return pb.PollWorkResponse(
            assignments=[
                pb.WorkAssignment(
                    job=name, nnodes=s.nnodes, nproc_per_node=s.nproc_per_node, argv=list(s.argv),
                    env=dict(s.env), max_restarts=s.max_restarts, cwd=s.cwd,
                    min_nodes=s.least_nodes, live_recovery=s.live_recovery,
                )
                for name, s in work
            ],
            cancelled=cancelled,
        )

    @_translated
    async def PushOutput(self, request: pb.PushOutputRequest, context: Any) -> pb.PushOutputResponse:
        self.state.authenticate(request.node_id, request.node_secret)
        lines = [(line.rank, line.stream, line.text) for line in request.lines]
        self.state.push_output(request.job, request.node_id, lines)
        return pb.PushOutputResponse()

    async def StreamJob(self, request: pb.StreamJobRequest, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.JobEvent]:
        """Every event of the job from its start, then new ones as they come, ending with JobFinished."""
        if isinstance(request, Undecodable):
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"the StreamJob request body does not parse: {request.error[:200]}")
            return
        job, index = request.job, 0
        while True:
            try:
                events, index, skipped, finished = self.state.read_events(job, index)
            except StateError as e:
                code, text = status_of(e)  # type: ignore[misc]
                refuse(context, code, text)
                return
            if self.commits is not None and (events or skipped or finished):
                try:
                    await self.commits.durable()
                except StateError as e:
                    code, text = status_of(e)  # type: ignore[misc]
                    refuse(context, code, text)
                    return
            if skipped:
                yield pb.JobEvent(
                    info=f"{skipped} earlier events were dropped: the job's output exceeded the coordinator's "
                    "limit (max_output_bytes_per_job) or this stream fell behind"
                )
            for event in events:
                yield _event_pb(event)
                if isinstance(event, FinishedEvent):
                    return
            if finished and not events:
                return
            if events or skipped:
                continue  # re-read before waiting: the yields above let other coroutines add events unseen
            await self.hub.wait([("events", job)], 30.0)

    @_translated
    async def CancelJob(self, request: pb.CancelJobRequest, context: Any) -> pb.CancelJobResponse:
        self.state.cancel_job(request.job, time.monotonic())
        return pb.CancelJobResponse()

    @_translated
    async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> pb.GetStatusResponse:
        snap = self.state.status(request.job, time.monotonic(), request.all, request.max_ranks)
        return pb.GetStatusResponse(
            nodes=[
                pb.NodeStatus(
                    node_id=n.node_id, hostname=n.hostname, health=cast("pb.NodeHealth", n.health.value),
                    last_heartbeat_age_s=n.last_heartbeat_age_s, slots=n.slots, daemon=n.daemon, job=n.job,
                )
                for n in snap.nodes
            ],
            jobs=[
                pb.JobStatus(
                    job=j.job, state=job_state_pb(j.state), generation=j.generation, world_size=j.world_size,
                    nnodes=j.nnodes, restarts=j.restarts, max_restarts=j.max_restarts, reason=j.reason,
                    ranks=[
                        pb.RankStatus(
                            rank=r.rank, node_id=r.node_id, local_rank=r.local_rank, node_rank=r.node_rank,
                            hostname=r.hostname, pid=r.pid,
                        )
                        for r in j.ranks
                    ],
                    min_nodes=j.min_nodes, max_nodes=j.max_nodes, joined_hosts=list(j.joined_hosts),
                    ranks_omitted=j.ranks_omitted, finished_age_s=j.finished_age_s, wall_s=j.wall_s,
                    goodput=[pb.GoodputPart(cause=c, seconds=s) for c, s in j.goodput],
                )
                for j in snap.jobs
            ],
        )
