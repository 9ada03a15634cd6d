"""`FrozenWatch` on real rank processes: a rank stopped (SIGSTOP) for longer than the lease is killed, and its
failure names the stop; a shorter stop, a running rank and a watch outside a live job kill nothing.

The watch is given its clock (`check(now=...)`), so the lease is crossed by configured values, not by sleeping.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from axond.worker.frozen import FrozenWatch, stopped
from axond.worker.launcher import LocalRanks, RankSpec, start_ranks

LEASE_S = 1.0


def sleepers(n: int) -> LocalRanks:
    specs = [RankSpec(rank=4 + i, local_rank=i, env=dict(os.environ)) for i in range(n)]
    return start_ranks([sys.executable, "-c", "import time; time.sleep(60)"], specs, sink=lambda *a: None)


def wait_stopped(pid: int, want: bool) -> None:
    deadline = time.monotonic() + 10.0
    while stopped(pid) != want:
        assert time.monotonic() < deadline, f"pid {pid} never became {'stopped' if want else 'running'}"
        time.sleep(0.01)


@pytest.fixture
def ranks() -> Iterator[LocalRanks]:
    r = sleepers(2)
    yield r
    for rank in r.ranks:
        rank.signal_group(signal.SIGKILL)
    r.stop(grace=0.5)


def test_a_rank_stopped_longer_than_the_lease_is_killed_and_its_failure_names_the_stop(ranks: LocalRanks) -> None:
    watch = FrozenWatch(ranks, LEASE_S)
    frozen, running = ranks.local_pids()
    os.kill(frozen, signal.SIGSTOP)
    wait_stopped(frozen, True)
    t0 = time.monotonic()
    assert watch.check(now=t0) == [] and watch.check(now=t0 + LEASE_S) == []  # stopped, not longer than the lease
    (line,) = watch.check(now=t0 + LEASE_S + 0.1)
    assert line.startswith("rank 4 was stopped (SIGSTOP) for 1.1 s, longer than the node's lease (1 s)"), line
    result = ranks.wait(10.0)
    assert result is not None and result.first_failure is not None
    failure = watch.explain(result.first_failure)
    assert (failure.rank, failure.exit_code) == (4, 128 + signal.SIGKILL)
    assert "stopped (SIGSTOP) for 1.1 s" in failure.describe(), failure.describe()
    assert ranks.local_pids()[1] == running and not stopped(running)  # the other rank was never touched
    assert watch.check(now=t0 + 10 * LEASE_S) == []


def test_a_short_stop_is_forgiven_and_a_watch_outside_a_live_job_kills_nothing(ranks: LocalRanks) -> None:
    watch, idle = FrozenWatch(ranks, LEASE_S), FrozenWatch(ranks, LEASE_S, active=False)
    pid = ranks.local_pids()[0]
    os.kill(pid, signal.SIGSTOP)
    wait_stopped(pid, True)
    t0 = time.monotonic()
    assert watch.check(now=t0) == [] and idle.check(now=t0) == []
    os.kill(pid, signal.SIGCONT)  # resumed within the lease: its stop is forgotten
    wait_stopped(pid, False)
    assert watch.check(now=t0 + LEASE_S / 2) == []
    os.kill(pid, signal.SIGSTOP)
    wait_stopped(pid, True)
    assert watch.check(now=t0 + LEASE_S * 1.5) == []  # a new stop: the lease counts from now
    assert idle.check(now=t0 + 100 * LEASE_S) == []  # not a live job: left to the group's timeout
    assert ranks.poll() is None and ranks.local_pids()[0] == pid
    os.kill(pid, signal.SIGCONT)


def test_a_gone_process_is_not_stopped() -> None:
    assert not stopped(2**22 + 12345)
