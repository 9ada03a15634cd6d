"""The per-job, per-generation KV store and barriers through a real coordinator."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from axond.control.client import CoordinatorClient, connect
from axond.store.coordinator import CoordinatorStore
from axond.coordinator.server import RunningCoordinator
from axond.errors import StoreError, StoreTimeout
from axond.v1 import coordinator_pb2 as pb


def job_store(client: CoordinatorClient, job: str = "j", max_restarts: int = 1) -> tuple[str, CoordinatorStore]:
    node = client.register_node("h").node_id
    gen = client.join(job, node, 1, 1, 1, max_restarts, timeout=5.0).generation
    return node, client.store(job, gen)


def test_get_with_wait_sees_a_set_from_another_client(coordinator: RunningCoordinator, client: CoordinatorClient) -> None:
    _, store = job_store(client)
    with connect(coordinator.address, call_timeout=5.0) as other:
        writer = other.store("j", store.generation)
        got: list[bytes] = []
        readers = [threading.Thread(target=lambda: got.append(store.get("nccl_id", timeout=10.0))) for _ in range(4)]
        for t in readers:
            t.start()
        time.sleep(0.2)
        assert not got, "get must wait for the key"
        writer.set("nccl_id", b"\x00\x01addr")
        for t in readers:
            t.join(timeout=10)
        assert got == [b"\x00\x01addr"] * 4


def test_add_cas_delete_wait(client: CoordinatorClient) -> None:
    _, store = job_store(client)
    with ThreadPoolExecutor(8) as pool:
        results = sorted(f.result(timeout=10) for f in [pool.submit(store.add, "count", 1) for _ in range(32)])
    assert results == list(range(1, 33))
    assert store.compare_set("leader", None, b"r0") == (True, b"r0")
    assert store.compare_set("leader", None, b"r1") == (False, b"r0")
    assert store.compare_set("leader", b"r0", b"r2") == (True, b"r2")
    assert store.delete("leader") is True and store.delete("leader") is False
    assert store.try_get("leader") is None
    with pytest.raises(StoreTimeout, match="not set within 0.2 s"):
        store.get("leader", timeout=0.2)
    waiter = threading.Thread(target=store.wait, args=(["a", "b"], 10.0))
    waiter.start()
    store.set("a", b"1")
    time.sleep(0.1)
    assert waiter.is_alive(), "wait must block until every key is set"
    store.set("b", b"2")
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match=r"\['c'\]"):
        store.wait(["a", "c"], timeout=0.3)
    assert time.monotonic() - t0 < 3.0


def test_a_retried_add_or_swap_with_its_request_id_gets_the_first_answer(client: CoordinatorClient) -> None:
    _, store = job_store(client)
    add = pb.KvAddRequest(job="j", generation=store.generation, key="n", delta=5, request_id="retry-1")
    assert client.stub.KvAdd(add, timeout=5).value == 5
    assert client.stub.KvAdd(add, timeout=5).value == 5, "a repeated request id must not add again"
    add.request_id = "retry-2"
    assert client.stub.KvAdd(add, timeout=5).value == 10
    assert store.add("n", 0) == 10
    swap = pb.KvCompareAndSetRequest(job="j", generation=store.generation, key="lock", expect_unset=True,
                                     desired=b"r0", request_id="swap-1")
    assert client.stub.KvCompareAndSet(swap, timeout=5).swapped
    again = client.stub.KvCompareAndSet(swap, timeout=5)
    assert again.swapped and again.current == b"r0", "the retry of a swap that happened says it swapped"
    swap.request_id = "swap-2"
    assert not client.stub.KvCompareAndSet(swap, timeout=5).swapped
    for bad in ("x" * 65,):
        add.request_id = bad
        with pytest.raises(grpc.RpcError) as e:
            client.stub.KvAdd(add, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
    with pytest.raises(StoreError, match="cannot start with a NUL"):
        store.set("\x00answered:retry-1", b"forged")


def test_barrier_releases_all_participants_together(client: CoordinatorClient) -> None:
    _, store = job_store(client)
    released: list[float] = []
    lock = threading.Lock()

    def arrive(delay: float) -> None:
        time.sleep(delay)
        store.barrier("step-1", 3, timeout=10.0)
        with lock:
            released.append(time.monotonic())

    threads = [threading.Thread(target=arrive, args=(d,)) for d in (0.0, 0.1, 0.4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert len(released) == 3 and min(released) - t0 >= 0.35
    with pytest.raises(StoreTimeout, match="step-2"):
        store.barrier("step-2", 2, timeout=0.2)
    with pytest.raises(StoreError, match="single-use"):
        store.barrier("step-1", 3, timeout=1.0)


def test_store_of_an_old_generation_is_refused(client: CoordinatorClient) -> None:
    node, store = job_store(client)
    store.set("k", b"v")
    client.report_failure("j", node, store.generation, 0, 1, "crash")
    with pytest.raises(StoreError, match="FAILED_PRECONDITION.*is over"):
        store.get("k", timeout=1.0)
    got = client.join("j", node, 1, 1, 1, 1, timeout=5.0)
    fresh = client.store("j", got.generation)
    assert fresh.try_get("k") is None, "a new generation starts with an empty store"


def test_waiter_of_a_generation_that_ends_is_woken_with_an_error(client: CoordinatorClient) -> None:
    node, store = job_store(client)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            store.get("never", timeout=20.0)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t0 = time.monotonic()
    t.start()
    time.sleep(0.2)
    client.report_failure("j", node, store.generation, 0, 1, "crash")
    t.join(timeout=10)
    assert time.monotonic() - t0 < 5.0 and isinstance(errors[0], StoreError) and "is over" in str(errors[0])


def test_a_wait_longer_than_one_coordinator_round_takes_several(coordinator: RunningCoordinator,
                                                                 client: CoordinatorClient) -> None:
    """The coordinator bounds one call's wait (a day); the store asks again until the caller's timeout. Here a
    round is 0.05 s, so every wait below spans several."""
    _, store = job_store(client)
    store.round_s = 0.05
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="never"):
        store.wait(["never"], 0.3)
    assert time.monotonic() - t0 >= 0.3 * 0.9  # not the first round's 0.05 s
    calls: list[str] = []
    second_round = threading.Event()
    real_call = store._call

    def counting(op: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(op)
        if calls.count(op) == 2:
            second_round.set()
        return real_call(op, *args, **kwargs)

    store._call = counting  # type: ignore[method-assign]
    with connect(coordinator.address, call_timeout=5.0) as other:
        peer = other.store("j", store.generation)
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(store.get, "later", 30.0)
            assert second_round.wait(30.0)
            peer.set("later", b"v")
            assert got.result(30.0) == b"v"
            calls.clear()
            second_round.clear()
            arrived = pool.submit(store.barrier, "b", 2, 30.0)
            assert second_round.wait(30.0)  # the same arrival, asked again
            peer.barrier("b", 2, 30.0)
            arrived.result(30.0)
