"""Group commit of the durable coordinator: a failed commit is never acknowledged, nor read by anyone.

(That an answered change survives kill -9 during a burst: tests/coordinator/test_coordinator_persistence.py.)
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest

from axond.control.client import connect
from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.persistence.sqlite import DB_NAME
from axond.coordinator.server import CoordinatorConfig, start_coordinator
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_failed_commit_answers_unavailable_and_never_acknowledges(tmp_path: Path) -> None:
    """A second SQLite connection holds the write lock: the commit cannot happen and fails; every call answers
    UNAVAILABLE (nothing uncommitted is acknowledged or read) until the write succeeds again."""
    state = tmp_path / "state"
    config = CoordinatorConfig(host="127.0.0.1", port=0, token="t", state_dir=str(state),
                               limits=CoordinatorLimits(commit_timeout_s=1.0))
    running = start_coordinator(config)
    auth = [("authorization", "Bearer t")]
    try:
        with connect(running.address, token="t", call_timeout=5.0) as c:
            node = c.register_node("host-a").node_id
            gen = c.join("j", node, 1, 1, 1, timeout=10.0).generation
            c.store("j", gen).set("kept", b"1")
        blocker = sqlite3.connect(state / DB_NAME, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")

        async def while_blocked() -> tuple[grpc.StatusCode, grpc.StatusCode, grpc.StatusCode]:
            async with grpc.aio.insecure_channel(running.address) as channel:
                stub = pb_grpc.CoordinatorStub(channel)

                async def code(call: object) -> grpc.StatusCode:
                    try:
                        await call  # type: ignore[misc]
                    except grpc.aio.AioRpcError as e:
                        return e.code()
                    return grpc.StatusCode.OK

                setting = asyncio.ensure_future(code(stub.KvSet(
                    pb.KvSetRequest(job="j", generation=gen, key="pending", value=b"2"), timeout=10, metadata=auth)))
                await asyncio.sleep(0.2)
                reading = code(stub.KvGet(pb.KvGetRequest(job="j", generation=gen, key="pending"), timeout=10,
                                          metadata=auth))
                return await setting, await reading, await code(
                    stub.KvGet(pb.KvGetRequest(job="j", generation=gen, key="kept"), timeout=10, metadata=auth))

        set_code, read_code, kept_code = asyncio.run(while_blocked())
        assert set_code == grpc.StatusCode.UNAVAILABLE, "a set whose commit did not finish is not acknowledged"
        assert read_code == grpc.StatusCode.UNAVAILABLE, "nobody reads a value that is not committed"
        assert kept_code == grpc.StatusCode.UNAVAILABLE, "answers wait for the pending commit"
        with connect(running.address, token="t", call_timeout=2.0) as c:
            deadline = time.monotonic() + 20
            while c.health(timeout=1.0) and time.monotonic() < deadline:
                time.sleep(0.2)  # SQLite gives up on the lock after its 5 s busy timeout
            assert not c.health(timeout=1.0), "a coordinator that cannot commit says NOT_SERVING"
        blocker.execute("ROLLBACK")
        blocker.close()
        # The lock is gone: the batch whose write failed is written again, and the coordinator serves by itself.
        with connect(running.address, token="t", call_timeout=5.0) as c:
            deadline = time.monotonic() + 20
            while not c.health(timeout=1.0) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.health(timeout=1.0), "a coordinator whose write succeeded again says SERVING"
            assert c.store("j", gen).get("kept", timeout=1.0) == b"1"
    finally:
        running.stop(grace=0.2)
    running = start_coordinator(config)
    try:
        with connect(running.address, token="t", call_timeout=5.0) as c:
            store = c.store("j", gen)
            assert store.get("kept", timeout=1.0) == b"1"
            # Answered UNAVAILABLE ("may or may not have been kept"): its batch was written when the lock went.
            assert store.try_get("pending") == b"2"
    finally:
        running.stop(grace=0.2)


@pytest.mark.timeout(60)
def test_concurrent_sets_share_transactions_and_a_clean_stop_keeps_them(tmp_path: Path) -> None:
    config = CoordinatorConfig(host="127.0.0.1", port=0, token="t", state_dir=str(tmp_path / "state"))
    running = start_coordinator(config)
    try:
        with connect(running.address, token="t", call_timeout=5.0) as c:
            node = c.register_node("host-a").node_id
            gen = c.join("j", node, 1, 1, 1, timeout=10.0).generation
        auth = [("authorization", "Bearer t")]

        async def sets() -> None:
            async with grpc.aio.insecure_channel(running.address) as channel:
                stub = pb_grpc.CoordinatorStub(channel)
                await asyncio.gather(*(
                    stub.KvSet(pb.KvSetRequest(job="j", generation=gen, key=f"k{i}", value=b"v"), timeout=10,
                               metadata=auth)
                    for i in range(400)))

        commits = running.commits
        assert commits is not None
        before = commits.batches
        asyncio.run(sets())
        assert commits.batches - before < 400 and commits.largest_batch > 1, "calls share transactions"
        running.state.kv_set("j", gen, "last", b"v")  # from this thread: nobody waits for its commit but stop
    finally:
        running.stop(grace=0.2)
    running = start_coordinator(config)
    try:
        with connect(running.address, token="t", call_timeout=5.0) as c:
            store = c.store("j", gen)
            assert [store.try_get(f"k{i}") for i in range(400)] == [b"v"] * 400
            assert store.try_get("last") == b"v"
    finally:
        running.stop(grace=0.2)
