"""`OpQueue`: a group's async ops run one at a time in issue order, on its thread or on a thread that waits for
one the thread has not started (`help`)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest

from axond.distributed.work import OpQueue, Work


@pytest.fixture
def comm() -> Iterator[OpQueue]:
    c = OpQueue("test")
    yield c
    c.close(5.0)


def _submit(comm: OpQueue, name: str, fn: object) -> Work:
    return comm.submit(Work(name, "test", 5.0, comm), fn)  # type: ignore[arg-type]


def test_a_wait_right_after_submit_runs_the_op_on_the_waiting_thread(comm: OpQueue) -> None:
    _submit(comm, "warm-up", lambda: None).wait()  # the thread exists and idles
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # the woken thread cannot take the interpreter before this one blocks
    try:
        work = _submit(comm, "op", threading.get_ident)
        assert work.result() == threading.get_ident()
    finally:
        sys.setswitchinterval(old)
    assert not comm.pending


def test_ops_run_one_at_a_time_in_issue_order_whoever_runs_them(comm: OpQueue) -> None:
    ran: list[str] = []
    gate = threading.Event()
    first = _submit(comm, "a", lambda: (gate.wait(5.0), ran.append("a")))
    works = [first] + [_submit(comm, name, lambda name=name: ran.append(name)) for name in "bc"]
    waiter = threading.Thread(target=works[2].wait)  # the last op, waited for while the first one blocks
    waiter.start()
    time.sleep(0.05)
    assert ran == [] and not works[2].is_completed()
    gate.set()
    waiter.join(5.0)
    assert not waiter.is_alive() and ran == ["a", "b", "c"]
    assert all(w.is_completed() for w in works)


def test_a_failure_stays_in_its_work_and_the_next_op_still_runs(comm: OpQueue) -> None:
    failing = _submit(comm, "bad", lambda: 1 // 0)
    after = _submit(comm, "good", lambda: 7)
    with pytest.raises(ZeroDivisionError):
        failing.wait()
    assert after.result() == 7


def test_a_bounded_wait_only_waits(comm: OpQueue) -> None:
    gate = threading.Event()
    _submit(comm, "blocker", lambda: gate.wait(5.0))
    work = _submit(comm, "op", lambda: 1)
    started = time.monotonic()
    assert work.wait(timeout=0.05) is False  # the thread is busy: nothing to help with, and no waiting past 0.05 s
    assert time.monotonic() - started < 2.0
    gate.set()
    assert work.result() == 1


def test_drain_runs_the_queued_ops_before_returning(comm: OpQueue) -> None:
    ran: list[int] = []
    works = [_submit(comm, f"op{k}", lambda k=k: ran.append(k)) for k in range(5)]
    comm.drain()
    assert ran == list(range(5)) and all(w.is_completed() for w in works) and not comm.pending


def test_done_callbacks_run_once_on_the_finishing_thread_or_at_once(comm: OpQueue) -> None:
    gate = threading.Event()
    seen: list[tuple[str, int]] = []
    work = _submit(comm, "op", lambda: gate.wait(5.0))
    work.add_done_callback(lambda w: seen.append((w.op, threading.get_ident())))
    assert seen == []
    gate.set()
    work.wait()
    ran_on = {threading.get_ident(), comm._thread.ident if comm._thread is not None else 0}
    assert len(seen) == 1 and seen[0][0] == "op" and seen[0][1] in ran_on  # whichever thread ran the op
    work.add_done_callback(lambda w: seen.append(("late", threading.get_ident())))  # already done: at once, here
    assert seen[-1] == ("late", threading.get_ident()) and len(seen) == 2
