"""The NCCL watchdog's timing logic with real threads (no GPU): a hung op aborts the communicator.

An op is watched through its `done()` callable; here it is a `threading.Event`, standing in for the
CUDA event query, and `abort` records the call that would be `NcclCommunicator.abort()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from axond.distributed.backends.nccl.watchdog import Watchdog, WatchedOp
from axond.errors import DistributedError


class Comm:
    """Records aborts and can report an asynchronous error, like ncclCommGetAsyncError."""

    def __init__(self) -> None:
        self.aborts = 0
        self.error: str | None = None

    def abort(self) -> None:
        self.aborts += 1

    def async_error(self) -> str | None:
        return self.error


@pytest.fixture
def comm() -> Comm:
    return Comm()


@pytest.fixture
def dog(comm: Comm) -> Iterator[Watchdog]:
    dog = Watchdog(group="tp0", rank=2, abort=comm.abort, async_error=comm.async_error, tick=0.01)
    try:
        yield dog
    finally:
        dog.close()
        assert not dog._thread.is_alive()


def op(name: str, timeout: float, flag: threading.Event, peer: int | None = None) -> WatchedOp:
    return WatchedOp(name, peer, time.monotonic() + timeout, flag.is_set)


def test_completed_op_returns_and_never_aborts(dog: Watchdog, comm: Comm) -> None:
    flag = threading.Event()
    watched = op("all_reduce", 5.0, flag)
    dog.watch(watched)
    threading.Timer(0.05, flag.set).start()
    assert dog.wait(watched) is True
    time.sleep(0.05)
    assert comm.aborts == 0 and dog.failure is None
    assert dog.in_flight() == 0 and watched.keep == (), "the watchdog drops completed ops (and the buffers they keep)"


def test_hung_op_aborts_once_and_the_waiter_raises(dog: Watchdog, comm: Comm) -> None:
    watched = op("broadcast", 0.2, threading.Event(), peer=1)
    dog.watch(watched)
    started = time.monotonic()
    with pytest.raises(DistributedError) as info:
        dog.wait(watched)
    assert 0.15 < time.monotonic() - started < 2
    e = info.value
    assert (e.op, e.group, e.rank, e.peer) == ("broadcast", "tp0", 2, 1)
    assert "ncclCommAbort" in str(e) and "did not complete" in str(e)
    assert comm.aborts == 1
    with pytest.raises(DistributedError, match="aborted") as later:
        dog.watch(op("all_gather", 5.0, threading.Event()))
    assert later.value.op == "all_gather"


def test_unwaited_async_op_is_aborted_by_the_thread(dog: Watchdog, comm: Comm) -> None:
    dog.watch(op("all_to_all", 0.1, threading.Event()))
    deadline = time.monotonic() + 3
    while dog.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.failure is not None and dog.failure.op == "all_to_all"
    assert comm.aborts == 1


def test_async_nccl_error_aborts_before_the_deadline(dog: Watchdog, comm: Comm) -> None:
    watched = op("reduce_scatter", 30.0, threading.Event())
    dog.watch(watched)
    comm.error = "NCCL_ERROR_SYSTEM_ERROR: remote process exited"
    started = time.monotonic()
    with pytest.raises(DistributedError, match="remote process exited"):
        dog.wait(watched)
    assert time.monotonic() - started < 2 and comm.aborts == 1


def test_device_error_in_event_query_fails_the_op(dog: Watchdog, comm: Comm) -> None:
    def broken() -> bool:
        raise RuntimeError("cudaErrorIllegalAddress")

    watched = WatchedOp("reduce", 0, time.monotonic() + 30, broken)
    dog.watch(watched)
    with pytest.raises(DistributedError, match="cudaErrorIllegalAddress"):
        dog.wait(watched)
    assert comm.aborts == 1


def test_short_wait_timeout_returns_false_without_aborting(dog: Watchdog, comm: Comm) -> None:
    flag = threading.Event()
    watched = op("gather", 30.0, flag)
    dog.watch(watched)
    assert dog.wait(watched, timeout=0.05) is False
    assert comm.aborts == 0 and dog.failure is None and not watched.aborted
    flag.set()
    assert dog.wait(watched, timeout=1.0) is True


def test_failing_abort_is_reported(comm: Comm) -> None:
    def abort() -> None:
        raise RuntimeError("ncclCommAbort is not available in this version")

    dog = Watchdog(group="g", rank=0, abort=abort, tick=0.01)
    try:
        watched = op("barrier", 0.05, threading.Event())
        dog.watch(watched)
        with pytest.raises(DistributedError, match="ncclCommAbort itself failed"):
            dog.wait(watched)
    finally:
        dog.close()


def test_event_that_fires_because_of_the_abort_is_not_success(comm: Comm) -> None:
    """ncclCommAbort kills the kernels, so the op's event completes: the waiter must still raise."""
    flag = threading.Event()

    def abort() -> None:
        comm.abort()
        flag.set()

    dog = Watchdog(group="g", rank=1, abort=abort, tick=0.01)
    try:
        watched = op("all_reduce", 0.1, flag)
        dog.watch(watched)
        with pytest.raises(DistributedError, match="did not complete"):
            dog.wait(watched)
        assert watched.aborted and comm.aborts == 1
    finally:
        dog.close()


def test_a_timeout_says_what_the_peers_do_and_survives_a_failing_explanation(dog: Watchdog, comm: Comm) -> None:
    asked: list[str] = []

    def explain(watched: WatchedOp) -> str:
        asked.append(watched.op)
        return "peer rank 1 reports no op blocked for over 10.0 s"

    dog.explain = explain
    watched = op("all_reduce", 0.1, threading.Event())
    dog.watch(watched)
    with pytest.raises(DistributedError) as info:
        dog.wait(watched)
    assert "did not complete within" in str(info.value)
    assert "s (peer rank 1 reports no op blocked for over 10.0 s); the communicator was aborted" in str(info.value)
    assert asked == ["all_reduce"] and comm.aborts == 1


def test_an_explanation_that_raises_only_loses_the_hint(comm: Comm) -> None:
    dog = Watchdog(group="g", rank=0, abort=comm.abort, tick=0.01)
    dog.explain = lambda watched: (_ for _ in ()).throw(OSError("store down"))
    try:
        dog.watch(op("barrier", 0.05, threading.Event()))
        deadline = time.monotonic() + 2
        while dog.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "(the peers could not be asked what they do: OSError)" in str(dog.failure)
        assert comm.aborts == 1
    finally:
        dog.close()
