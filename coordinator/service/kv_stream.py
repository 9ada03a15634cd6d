"""The KV calls over one long-lived stream (`KvStream`): many requests per message, each answered by id.

A gRPC call costs this server ~0.6-0.9 ms of CPU whatever it does; a message on an open stream
costs a fraction of that, and one message may carry many requests (a client's concurrent callers,
batched). Each request (`KvOp`) is validated, bounded and answered exactly as its unary call would
be (`kv_calls.py`), with its own status in its `KvResult`: an error fails that request only and
the stream stays open. Requests that cannot wait run at once, in order; those that may wait (a get
with a wait, KvWait, Barrier) run as tasks, so answers may come out of order. At most
`MAX_STREAM_REQUESTS` requests are in flight per stream; past that a request is answered
RESOURCE_EXHAUSTED. With a durable state a message's answers wait for the group commit of
everything the state had changed when they were computed, while the stream reads on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from axond.coordinator.state.errors import InvalidArgument, StateError
from axond.coordinator.service.admission import StreamBytes, stream_bytes
from axond.coordinator.service.kv_calls import KvCalls, WaitExpired, may_wait
from axond.coordinator.persistence.group_commit import GroupCommit
from axond.coordinator.service.status_codes import MAX_DETAIL_CHARS, Undecodable, refuse, status_of
from axond.v1 import coordinator_pb2 as pb

log = logging.getLogger("axond.coordinator")

MAX_STREAM_REQUESTS = 1_024
"""Requests one KvStream may have in flight (accepted, not yet answered)."""
MAX_RESULTS_PER_MESSAGE = 4_096
"""Answers sent in one KvStreamResponse at most (ready answers are coalesced up to this)."""


class IdleStream(Exception):
    """A stream that stayed idle too long (ended UNAVAILABLE)."""


def _failed(op_id: int, e: BaseException) -> pb.KvResult:
    mapped = status_of(e)
    if mapped is None:
        log.error("KvStream request %d failed", op_id, exc_info=e)
        code, text = grpc.StatusCode.INTERNAL, f"coordinator error in KvStream: {e!r}"[:MAX_DETAIL_CHARS]
    else:
        code, text = mapped
    return pb.KvResult(id=op_id, code=code.value[0], message=text)


class KvStreamHandler:
    """Serves `KvStream` calls over the coordinator's `KvCalls`."""

    def __init__(self, kv: KvCalls, commits: GroupCommit | None, max_in_flight: int = MAX_STREAM_REQUESTS,
                 idle_s: float = 60.0) -> None:
        self.kv = kv
        self.idle_s = idle_s
        self.commits = commits
        self.max_in_flight = max_in_flight
        self._calls: dict[str, Callable[[Any], Awaitable[Any]]] = {
            "set": kv.set, "get": kv.get, "add": kv.add, "compare_set": kv.compare_set, "delete": kv.delete,
            "wait": kv.wait, "barrier": kv.barrier,
        }

    async def _run(self, op: pb.KvOp) -> pb.KvResult:
        """One request's answer (never raises but for cancellation)."""
        kind = op.WhichOneof("op")
        try:
            if kind is None:
                raise InvalidArgument(f"KvStream request {op.id} names no operation (set, get, add, ...)")
            reply = await self._calls[kind](getattr(op, kind))
        except (StateError, WaitExpired) as e:
            return _failed(op.id, e)
        except Exception as e:  # noqa: BLE001 - a bug answers INTERNAL for this request, the stream goes on
            return _failed(op.id, e)
        result = pb.KvResult(id=op.id)
        getattr(result, kind).CopyFrom(reply)
        return result

    async def _durable(self, results: list[pb.KvResult]) -> list[pb.KvResult]:
        """`results` once everything changed so far is committed; each UNAVAILABLE if that fails."""
        commits = self.commits
        if commits is None or (commits.needed <= commits.committed and commits.failed is None):
            return results
        try:
            await commits.durable()
        except StateError as e:
            return [_failed(r.id, e) for r in results]
        return results

    async def serve(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
                    ) -> AsyncIterator[pb.KvStreamResponse]:
        """Read requests and send answers until the client half-closes and every answer has left."""
        out: asyncio.Queue[list[pb.KvResult] | None] = asyncio.Queue()
        held = stream_bytes()
        in_flight = [0]
        tasks: set[asyncio.Task[None]] = set()

        def spawn(coro: Awaitable[list[pb.KvResult]]) -> None:
            async def deliver() -> None:
                out.put_nowait(await coro)

            task = asyncio.ensure_future(deliver())
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        async def read() -> None:
            try:
                async for message in self._until_idle(requests, lambda: in_flight[0] > 0 or bool(tasks)):
                    if isinstance(message, Undecodable):
                        raise InvalidArgument(f"a KvStream request does not parse: {message.error[:200]}")
                    await self._accept(message, in_flight, spawn, out, held)
                while tasks:
                    await asyncio.wait(list(tasks))
            finally:
                out.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                batch = await out.get()
                if batch is None:
                    break
                while not out.empty() and len(batch) < MAX_RESULTS_PER_MESSAGE:
                    more = out.get_nowait()
                    if more is None:
                        out.put_nowait(None)
                        break
                    batch.extend(more)
                yield pb.KvStreamResponse(results=batch)
                in_flight[0] -= len(batch)
            error = reader.exception()
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
        if isinstance(error, IdleStream):
            refuse(context, grpc.StatusCode.UNAVAILABLE, str(error))
        elif isinstance(error, StateError):
            code, text = status_of(error)  # type: ignore[misc]
            refuse(context, code, text)
        elif error is not None:
            log.error("KvStream failed", exc_info=error)
            refuse(context, grpc.StatusCode.INTERNAL, f"coordinator error in KvStream: {error!r}")

    async def _until_idle(self, requests: AsyncIterator[Any], busy: Callable[[], bool]) -> AsyncIterator[Any]:
        """The stream's messages; raises `IdleStream` once none came for `idle_s` seconds while nothing was in
        flight (an idle stream holds a call of its client's share and memory for nothing)."""
        it = requests.__aiter__()
        nxt: asyncio.Future[Any] = asyncio.ensure_future(it.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait([nxt], timeout=self.idle_s)
                if not done:
                    if not busy():
                        raise IdleStream(f"the coordinator closed this KV stream: no request for {self.idle_s:g} s "
                                         "(stream_idle_s); open another when needed")
                    continue
                try:
                    message = nxt.result()
                except StopAsyncIteration:
                    return
                yield message
                nxt = asyncio.ensure_future(it.__anext__())
        finally:
            nxt.cancel()

    async def _accept(self, message: Any, in_flight: list[int],
                      spawn: Callable[[Awaitable[list[pb.KvResult]]], None],
                      out: asyncio.Queue[list[pb.KvResult] | None], held: StreamBytes | None = None) -> None:
        """Run one message's requests: at once in order, those that may wait as tasks; queue the answers. A message
        with requests that wait stays in memory until the last of them is answered: its bytes count against the
        stream's address (`held`) until then, and past the budget its waiting requests are answered
        RESOURCE_EXHAUSTED."""
        ops = message.ops
        commits = self.commits
        kept: _Kept | None = None
        refused: str | None = None
        if commits is not None and (commits.pending_calls >= commits.max_batch or commits.failed is not None):
            try:
                await commits.room()
            except StateError as e:
                in_flight[0] += len(ops)
                out.put_nowait([_failed(op.id, e) for op in ops])
                return
        now: list[pb.KvResult] = []
        for op in ops:
            in_flight[0] += 1
            if in_flight[0] > self.max_in_flight:
                now.append(pb.KvResult(
                    id=op.id, code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                    message=f"KvStream request {op.id}: {self.max_in_flight} requests are already in flight on "
                    "this stream; wait for answers before sending more",
                ))
            elif may_wait(op):
                if held is not None and kept is None and refused is None:
                    size = message.ByteSize()
                    refused = held.take(size)
                    kept = _Kept(held, size) if refused is None else None
                if refused is not None:
                    now.append(pb.KvResult(id=op.id, code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                           message=f"KvStream request {op.id}: {refused}"))
                elif kept is not None:
                    kept.waiting += 1
                    spawn(self._kept(op, kept))
                else:
                    spawn(self._waited(op))
            else:
                now.append(await self._run(op))
        if now:
            if commits is None or (commits.needed <= commits.committed and commits.failed is None):
                out.put_nowait(now)
            else:
                spawn(self._durable(now))

    async def _waited(self, op: pb.KvOp) -> list[pb.KvResult]:
        return await self._durable([await self._run(op)])

    async def _kept(self, op: pb.KvOp, kept: _Kept) -> list[pb.KvResult]:
        try:
            return await self._waited(op)
        finally:
            kept.waiting -= 1
            if kept.waiting == 0:
                kept.held.give(kept.size)


class _Kept:
    """A message whose requests wait: its bytes, counted until the last of them is answered."""

    def __init__(self, held: StreamBytes, size: int) -> None:
        self.held, self.size, self.waiting = held, size, 0
