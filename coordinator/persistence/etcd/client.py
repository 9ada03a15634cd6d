"""A small typed client of etcd's v3 gRPC API (the KV and Lease calls the etcd state backend needs).

Every call has a deadline (`timeout`). With several endpoints (members of one etcd cluster) a call
that finds its member UNAVAILABLE goes to the next one; any member answers (etcd forwards to its
raft leader). Failures raise `EtcdError` naming the call and the endpoints.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import grpc

from axond.errors import CoordinatorError
from axond.etcdv3 import kv_pb2, rpc_pb2, rpc_pb2_grpc

R = TypeVar("R")

KeyValue = kv_pb2.KeyValue
Compare = rpc_pb2.Compare
RequestOp = rpc_pb2.RequestOp

PAGE_KEYS = 500
"""Keys one Range asks for when reading a prefix (etcd answers at most its request size limit, 1.5 MiB by
default, per request; several pages are read at one revision)."""
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 4 << 20)]


class EtcdError(CoordinatorError):
    """An etcd call failed (unreachable, timed out, refused)."""


def parse_state_url(url: str) -> tuple[list[str], str]:
    """`etcd://HOST:PORT[,HOST:PORT...][/PREFIX]` -> (endpoints, key prefix; default `/axond`)."""
    if not url.startswith("etcd://"):
        raise CoordinatorError(f"--state {url!r}: use etcd://HOST:PORT[,HOST:PORT...][/PREFIX]")
    rest = url[len("etcd://"):]
    hosts, _, path = rest.partition("/")
    endpoints = [h.strip() for h in hosts.split(",") if h.strip()]
    for endpoint in endpoints:
        try:
            port = urlsplit(f"//{endpoint}").port
        except ValueError as e:
            raise CoordinatorError(f"--state {url!r}: {endpoint!r} is not HOST:PORT") from e
        if port is None:
            raise CoordinatorError(f"--state {url!r}: {endpoint!r} has no port (etcd's client port is 2379)")
    if not endpoints:
        raise CoordinatorError(f"--state {url!r} names no etcd endpoint: use etcd://HOST:2379")
    prefix = "/" + path.strip("/") if path.strip("/") else "/axond"
    return endpoints, prefix


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix` (etcd's convention: last byte + 1)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def put_op(key: bytes, value: bytes, lease: int = 0) -> RequestOp:
    return RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


def delete_op(key: bytes, range_end: bytes = b"") -> RequestOp:
    return RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key, range_end=range_end))


def range_op(key: bytes) -> RequestOp:
    return RequestOp(request_range=rpc_pb2.RangeRequest(key=key))


def created_at(key: bytes, revision: int) -> Compare:
    """True while `key` is the one created at `revision` (0: while `key` does not exist)."""
    return Compare(result=Compare.EQUAL, target=Compare.CREATE, key=key, create_revision=revision)


class EtcdClient:
    """Channels to the endpoints of one etcd cluster; thread-safe."""

    def __init__(self, endpoints: Sequence[str], timeout: float = 5.0) -> None:
        if not endpoints:
            raise EtcdError("no etcd endpoint given")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        """Seconds each call may take."""
        self._channels = [grpc.insecure_channel(e, CHANNEL_OPTIONS) for e in self.endpoints]
        self._kv = [rpc_pb2_grpc.KVStub(c) for c in self._channels]
        self._lease = [rpc_pb2_grpc.LeaseStub(c) for c in self._channels]
        self._current = 0
        self._lock = threading.Lock()

    def _call(self, op: str, fn: Callable[[int, float], R], timeout: float | None = None) -> R:
        """`fn(endpoint index, timeout)`, moving to the next endpoint while members are UNAVAILABLE."""
        limit = self.timeout if timeout is None else timeout
        with self._lock:
            first = self._current
        error: grpc.RpcError | None = None
        for step in range(len(self.endpoints)):
            index = (first + step) % len(self.endpoints)
            try:
                reply = fn(index, limit)
            except grpc.RpcError as e:
                error = e
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    continue
                break
            with self._lock:
                self._current = index
            return reply
        assert error is not None
        raise EtcdError(
            f"etcd {op} at {','.join(self.endpoints)} failed: {error.code().name}: {error.details()} "
            "(is etcd running and reachable at --state etcd://HOST:PORT?)"
        ) from error

    def get(self, key: bytes) -> KeyValue | None:
        reply = self._call("Range", lambda i, t: self._kv[i].Range(rpc_pb2.RangeRequest(key=key), timeout=t))
        return reply.kvs[0] if reply.kvs else None

    def range(self, start: bytes, end: bytes, revision: int = 0) -> tuple[list[KeyValue], int]:
        """Every pair with start <= key < end, in key order, read at one `revision` (0: the newest);
        returns them and that revision."""
        found: list[KeyValue] = []
        while True:
            req = rpc_pb2.RangeRequest(key=start, range_end=end, limit=PAGE_KEYS, revision=revision)
            reply = self._call("Range", lambda i, t: self._kv[i].Range(req, timeout=t))
            revision = revision or reply.header.revision
            found.extend(reply.kvs)
            if not reply.more or not reply.kvs:
                return found, revision
            start = reply.kvs[-1].key + b"\0"

    def txn(self, compare: Iterable[Compare], success: Iterable[RequestOp],
            failure: Iterable[RequestOp] = ()) -> rpc_pb2.TxnResponse:
        req = rpc_pb2.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))
        response: rpc_pb2.TxnResponse = self._call("Txn", lambda i, t: self._kv[i].Txn(req, timeout=t))
        return response

    def compact(self, revision: int) -> None:
        """Drop etcd's history of older revisions (keys' current values stay)."""
        req = rpc_pb2.CompactionRequest(revision=revision)
        self._call("Compact", lambda i, t: self._kv[i].Compact(req, timeout=t))

    def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease; returns (its id, the TTL etcd granted)."""
        reply = self._call("LeaseGrant",
                           lambda i, t: self._lease[i].LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=ttl), timeout=t))
        if reply.error:
            raise EtcdError(f"etcd LeaseGrant at {','.join(self.endpoints)} failed: {reply.error}")
        return reply.ID, reply.TTL

    def keep_alive(self, lease: int, timeout: float | None = None) -> int:
        """Renew `lease` once; returns its remaining TTL (0: the lease is gone)."""
        def renew(i: int, t: float) -> int:
            call = self._lease[i].LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=lease)]), timeout=t)
            try:
                for reply in call:
                    return int(reply.TTL)
                return 0
            finally:
                call.cancel()

        return self._call("LeaseKeepAlive", renew, timeout)

    def revoke(self, lease: int) -> None:
        """End `lease` now: the keys attached to it go."""
        req = rpc_pb2.LeaseRevokeRequest(ID=lease)
        self._call("LeaseRevoke", lambda i, t: self._lease[i].LeaseRevoke(req, timeout=t))

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
