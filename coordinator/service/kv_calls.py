"""The KV store calls as plain coroutines: request proto -> `CoordinatorState` -> response proto.

Shared by the unary KV RPCs and the KV stream (`kv_stream.py`), so both validate, wait and fail
alike. Waits are bounded by the request's own wait and by `remaining` (the call's deadline, None if
it has none); domain errors are raised as `StateError`s, an expired wait as `WaitExpired`.
"""

from __future__ import annotations

from axond.coordinator.state.errors import InvalidArgument, NotFound, check_wait
from axond.coordinator.state.machine import CoordinatorState
from axond.coordinator.service.waiting import WaitHub
from axond.v1 import coordinator_pb2 as pb


class WaitExpired(Exception):
    """A server-side wait ran out; becomes DEADLINE_EXCEEDED."""


def bounded(wait_s: float, remaining: float | None) -> float:
    """`wait_s` cut to the time the call has left (`remaining`, None: no deadline)."""
    return wait_s if remaining is None else max(0.0, min(wait_s, remaining))


class KvCalls:
    """The KV and barrier calls of one coordinator."""

    def __init__(self, state: CoordinatorState, hub: WaitHub) -> None:
        self.state = state
        self.hub = hub

    async def set(self, request: pb.KvSetRequest, remaining: float | None = None) -> pb.KvSetResponse:
        self.state.kv_ops["set"] += 1
        self.state.kv_set(request.job, request.generation, request.key, request.value)
        return pb.KvSetResponse()

    async def get(self, request: pb.KvGetRequest, remaining: float | None = None) -> pb.KvGetResponse:
        self.state.kv_ops["get"] += 1
        wait_s = check_wait("wait_s", request.wait_s)
        job, gen, key = request.job, request.generation, request.key
        value = self.state.kv_get(job, gen, key)
        if value is None and wait_s > 0:
            value = await self.hub.until(
                bounded(wait_s, remaining),
                lambda: self.state.kv_get(job, gen, key),
                lambda: [("key", job, gen, key), ("job", job)],
            )
            if value is None:
                raise WaitExpired(f"store key {key!r} of job {job!r} was not set within {wait_s:g} s")
        if value is None:
            raise NotFound(f"store key {key!r} of job {job!r} generation {gen} is not set")
        return pb.KvGetResponse(value=value)

    async def add(self, request: pb.KvAddRequest, remaining: float | None = None) -> pb.KvAddResponse:
        self.state.kv_ops["add"] += 1
        return pb.KvAddResponse(value=self.state.kv_add(request.job, request.generation, request.key, request.delta,
                                                        request.request_id))

    async def compare_set(self, request: pb.KvCompareAndSetRequest,
                          remaining: float | None = None) -> pb.KvCompareAndSetResponse:
        self.state.kv_ops["compare_set"] += 1
        expected = None if request.expect_unset else request.expected
        swapped, current = self.state.kv_compare_set(
            request.job, request.generation, request.key, expected, request.desired, request.request_id
        )
        return pb.KvCompareAndSetResponse(swapped=swapped, is_set=current is not None, current=current or b"")

    async def delete(self, request: pb.KvDeleteRequest, remaining: float | None = None) -> pb.KvDeleteResponse:
        self.state.kv_ops["delete"] += 1
        return pb.KvDeleteResponse(existed=self.state.kv_delete(request.job, request.generation, request.key))

    async def wait(self, request: pb.KvWaitRequest, remaining: float | None = None) -> pb.KvWaitResponse:
        self.state.kv_ops["wait"] += 1
        wait_s = check_wait("wait_s", request.wait_s)
        job, gen, keys = request.job, request.generation, list(request.keys)
        missing = self.state.kv_missing(job, gen, keys)
        if missing:
            done = await self.hub.until(
                bounded(wait_s, remaining),
                lambda: True if not self.state.kv_missing(job, gen, keys) else None,
                lambda: [("key", job, gen, self.state.kv_missing(job, gen, keys)[0]), ("job", job)],
            )
            if done is None:
                missing = self.state.kv_missing(job, gen, keys)
                raise WaitExpired(f"store keys {missing[:4]} of job {job!r} were not set within {wait_s:g} s")
        return pb.KvWaitResponse()

    async def barrier(self, request: pb.BarrierRequest, remaining: float | None = None) -> pb.BarrierResponse:
        self.state.kv_ops["barrier"] += 1
        wait_s = check_wait("wait_s", request.wait_s)
        job, gen, name = request.job, request.generation, request.name
        if request.arrival_id:
            arrival = "id:" + request.arrival_id
        elif request.participant < request.world_size:
            arrival = f"participant:{request.participant}"
        else:
            raise InvalidArgument(
                f"barrier {name!r}: participant {request.participant} is outside 0..{request.world_size - 1}"
            )
        if not self.state.barrier_arrive(job, gen, name, request.world_size, arrival):
            done = await self.hub.until(
                bounded(wait_s, remaining),
                lambda: True if self.state.barrier_done(job, gen, name) else None,
                lambda: [("barrier", job, gen, name), ("job", job)],
            )
            if done is None:
                raise WaitExpired(f"barrier {name!r} of job {job!r} did not complete within {wait_s:g} s")
        return pb.BarrierResponse()


def may_wait(op: pb.KvOp) -> bool:
    """Whether the stream request `op` may wait (it then runs as a task of its own, not inline)."""
    kind = op.WhichOneof("op")
    return (kind == "get" and op.get.wait_s > 0) or kind in ("wait", "barrier")
