"""`CoordinatorStore`: the `axond.store.Store` of one job generation, kept by the coordinator.

Its calls travel over one KV stream per store (`kv_stream.py`: many callers' requests batched on one
long-lived call, far cheaper for the coordinator than a call each), or as unary calls when the
coordinator does not serve the stream or `streamed=False`.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from axond.control.errors import translate
from axond.control.kv_stream import KvStatus, KvStreamClient
from axond.errors import StoreError, StoreTimeout
from axond.store.base import Store, check_delta, check_key, check_keys, check_timeout, check_value
from axond.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient

T = TypeVar("T")
ROUND_S = 86400.0
"""The longest wait one call asks of the coordinator (its limit, MAX_WAIT_S); a longer wait takes several calls."""


class CoordinatorStore(Store):
    """KV calls scoped to (job, generation); waits and barriers are served natively by the coordinator.

    A stale generation (the job restarted) fails every call with StoreError: ranks of an old
    generation must exit. An expired wait raises StoreTimeout.
    """

    def __init__(self, client: CoordinatorClient, job: str, generation: int, streamed: bool = True) -> None:
        """`streamed`: send the calls over one KV stream (False: one unary call each)."""
        if not job:
            raise StoreError("the store needs a job name (AXOND_JOB)")
        if generation < 1:
            raise StoreError(f"generation {generation}: it must be >= 1 (AXOND_GENERATION)")
        self.client = client
        self.job = job
        self.generation = generation
        self.round_s = ROUND_S
        self._stream = KvStreamClient(client, f"{job}-{generation}") if streamed else None

    def _in_rounds(self, timeout: float, call: Callable[[float], T]) -> T:
        """`call(wait)` with waits of at most `round_s` seconds, until one answers or `timeout` has passed."""
        deadline, left = time.monotonic() + timeout, timeout
        while True:
            try:
                return call(min(left, self.round_s))
            except StoreTimeout:
                if left <= self.round_s:
                    raise
            left = max(0.0, deadline - time.monotonic())

    def _call(self, op: str, kind: str, method: Callable[..., Any], request: Any, wait: float = 0.0,
              retry: bool = False) -> Any:
        """`request` over the KV stream (the unary `method` without one), deadline `wait` + the call timeout."""
        stream = self._stream
        # Until a first call got through, unary calls: they wait for a coordinator that is still starting
        # (the client's connect_wait).
        if stream is not None and not stream.unsupported and self.client.reached:
            try:
                return stream.call(kind, request, time.monotonic() + wait + self.client.call_timeout)
            except KvStatus as e:
                resend = retry and e.stream_ended and e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                if not stream.unsupported and not resend:
                    raise translate(op, self.client.address, e, store=True) from e
        return self.client.call(op, method, request, wait=wait, retry=retry, store=True)

    def close(self) -> None:
        """End the store's KV stream (the coordinator keeps the keys)."""
        if self._stream is not None:
            self._stream.close()

    def set(self, key: str, value: bytes) -> None:
        raw = check_value(check_key(key), value)
        req = pb.KvSetRequest(job=self.job, generation=self.generation, key=key, value=raw)
        self._call("KvSet", "set", self.client.stub.KvSet, req, retry=True)

    def get(self, key: str, timeout: float) -> bytes:
        check_key(key)
        return self._in_rounds(check_timeout(timeout), lambda wait: self._get(key, wait))

    def _get(self, key: str, timeout: float) -> bytes:
        req = pb.KvGetRequest(job=self.job, generation=self.generation, key=key, wait_s=timeout)
        try:
            return self._call("KvGet", "get", self.client.stub.KvGet, req, wait=timeout, retry=True).value
        except StoreError as e:
            if isinstance(e.__cause__, grpc.RpcError) and e.__cause__.code() == grpc.StatusCode.NOT_FOUND and timeout == 0:
                raise StoreTimeout(f"store key {key!r} is not set (waited 0 s)") from e
            raise

    def try_get(self, key: str) -> bytes | None:
        req = pb.KvGetRequest(job=self.job, generation=self.generation, key=check_key(key), wait_s=0.0)
        try:
            return self._call("KvGet", "get", self.client.stub.KvGet, req, retry=True).value
        except StoreError as e:
            if isinstance(e.__cause__, grpc.RpcError) and e.__cause__.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def add(self, key: str, delta: int) -> int:
        # The request id makes the add safe to send again (a lost answer, a restarted coordinator, another
        # replica): the coordinator answers a repeated id with the first answer and adds nothing.
        step = check_delta(check_key(key), delta)
        req = pb.KvAddRequest(job=self.job, generation=self.generation, key=key, delta=step,
                              request_id=secrets.token_hex(12))
        return self._call("KvAdd", "add", self.client.stub.KvAdd, req, retry=True).value

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        want = b"" if expected is None else check_value(check_key(key), expected)
        req = pb.KvCompareAndSetRequest(
            job=self.job, generation=self.generation, key=key, expect_unset=expected is None,
            expected=want, desired=check_value(check_key(key), desired), request_id=secrets.token_hex(12),
        )
        resp = self._call("KvCompareAndSet", "compare_set", self.client.stub.KvCompareAndSet, req, retry=True)
        return resp.swapped, (resp.current if resp.is_set else None)

    def delete(self, key: str) -> bool:
        req = pb.KvDeleteRequest(job=self.job, generation=self.generation, key=check_key(key))
        return self._call("KvDelete", "delete", self.client.stub.KvDelete, req).existed

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        names = check_keys(keys)
        timeout = check_timeout(timeout)
        if not names:
            return

        def wait_for(wait: float) -> None:
            req = pb.KvWaitRequest(job=self.job, generation=self.generation, keys=names, wait_s=wait)
            self._call("KvWait", "wait", self.client.stub.KvWait, req, wait=wait, retry=True)

        self._in_rounds(timeout, wait_for)

    def barrier(self, name: str, world_size: int, timeout: float) -> None:
        """The coordinator's native barrier; each call is one arrival (retries reuse its id)."""
        timeout = check_timeout(timeout)
        if world_size < 1:
            raise StoreError(f"barrier {name!r}: world_size is {world_size}; it must be >= 1")
        arrival = uuid.uuid4().hex  # every round is the same arrival

        def arrive(wait: float) -> None:
            req = pb.BarrierRequest(job=self.job, generation=self.generation, name=name, world_size=world_size,
                                    wait_s=wait, arrival_id=arrival)
            self._call("Barrier", "barrier", self.client.stub.Barrier, req, wait=wait, retry=True)

        self._in_rounds(timeout, arrive)
