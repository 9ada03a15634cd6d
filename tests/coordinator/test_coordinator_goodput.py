"""Each job's wall time accounted by cause (`axond.coordinator.state.goodput`): the parts add up to the wall time,
in the state machine and end to end with a real worker and one injected restart; the ranks' start-up (before their
first collectives) and a hang are not productive."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
import urllib.request

import pytest

from axond.control.client import connect
from axond.coordinator.server import RunningCoordinator
from axond.coordinator.state.goodput import CAUSES
from axond.coordinator.state.machine import CoordinatorState
from axond.v1 import coordinator_pb2 as pb
from worker_support import FAST, Procs, procs  # noqa: F401

PY = sys.executable


def _parts(state: CoordinatorState, job: str, now: float) -> tuple[float, dict[str, float]]:
    [view] = state.status(job, now).jobs
    return view.wall_s, dict(view.goodput)


def test_a_dead_nodes_silence_is_charged_to_detection_and_the_parts_add_up() -> None:
    state = CoordinatorState(heartbeat_interval=0.05, dead_after_missed=2, settle_time=0.0)
    t0 = time.monotonic()
    a = state.register_node("a", 0, False, t0).node_id
    b = state.register_node("b", 0, False, t0).node_id
    state.join("j", a, 1, 2, 2, 1, now=t0)
    wall, parts = _parts(state, "j", t0)
    assert parts["waiting_for_members"] == 0.0 and wall == 0.0
    state.join("j", b, 1, 2, 2, 1, now=t0 + 1.0)  # one node waited 1 s for the other
    for rank in (0, 1):  # the ranks run their collectives at once
        state.kv_set("j", 1, f"axond/arrivals/{rank}", b"{}")
    _parts(state, "j", t0 + 1.0)
    state.heartbeat(a, "j", 1, now=t0 + 5.0)
    state.heartbeat(b, "j", 1, now=t0 + 5.0)  # b's last sign of life
    state.heartbeat(a, "j", 1, now=t0 + 7.0)
    state.tick(t0 + 7.0)  # b is dead: silent 2 s, far past its 0.1 s lease
    assert state.heartbeat(a, "j", 1, now=t0 + 7.0).state.name == "RESTARTING"
    state.join("j", a, 1, 2, 2, 1, now=t0 + 8.0)
    wall, parts = _parts(state, "j", t0 + 9.0)
    assert wall == 9.0
    assert parts["waiting_for_members"] == 1.0 + 2.0  # before b came, and since the restart (a alone)
    assert parts["productive"] == 4.0  # from the first generation's start to b's last heartbeat
    assert parts["detection"] == 2.0  # from b's last heartbeat to its death
    assert abs(sum(parts.values()) - wall) < 1e-9
    assert list(parts) == list(CAUSES)


def test_rank_start_up_and_a_hang_are_not_productive() -> None:
    state = CoordinatorState(heartbeat_interval=0.05, dead_after_missed=2, settle_time=0.0)
    t0 = time.monotonic()
    a = state.register_node("a", 0, False, t0).node_id
    state.join("k", a, 1, 1, 1, 1, now=t0)  # one node: the generation runs at once
    state.heartbeat(a, "k", 1, now=t0 + 2.0)
    wall, parts = _parts(state, "k", t0 + 2.0)
    assert parts["startup"] == 2.0 and parts["productive"] == 0.0, "its rank has not run a collective yet"
    state.kv_set("k", 1, "axond/arrivals/0", b"{}")
    wall, parts = _parts(state, "k", t0 + 3.0)  # the rank's first marks seen at this read
    assert parts["startup"] == 3.0 and parts["productive"] == 0.0
    blocked = {"pid": 1, "host": "h", "at": time.time(), "ops": [{"group": "world", "op": "all_reduce",
                                                                   "since": time.time() - 1.0, "seq": 9}]}
    state.kv_set("k", 1, "axond/inflight/0", json.dumps(blocked).encode())
    wall, parts = _parts(state, "k", t0 + 6.0)  # blocked since 1 s before this read: hung from t0 + 5
    assert parts["productive"] == pytest.approx(2.0, abs=0.1) and parts["hung"] == pytest.approx(1.0, abs=0.1)
    state.kv_set("k", 1, "axond/inflight/0", json.dumps({**blocked, "ops": []}).encode())
    wall, parts = _parts(state, "k", t0 + 8.0)  # no longer blocked at this read
    assert parts["hung"] == pytest.approx(3.0, abs=0.1) and parts["productive"] == pytest.approx(2.0, abs=0.1)
    wall, parts = _parts(state, "k", t0 + 9.0)
    assert parts["productive"] == pytest.approx(3.0, abs=0.1)
    assert abs(sum(parts.values()) - wall) < 1e-9 and wall == 9.0


def test_the_ranks_count_as_running_from_the_last_of_their_first_marks() -> None:
    state = CoordinatorState(heartbeat_interval=0.05, dead_after_missed=2, settle_time=0.0)
    t0 = time.monotonic()
    a = state.register_node("a", 0, False, t0).node_id
    state.join("m", a, 2, 1, 1, 1, now=t0)  # one node, two ranks: running at once
    state.heartbeat(a, "m", 1, now=t0 + 3.0)
    state.kv_set("m", 1, "axond/arrivals/0", json.dumps({"started": time.time() - 2.0}).encode())
    state.kv_set("m", 1, "axond/arrivals/1", json.dumps({"started": time.time() - 1.0}).encode())
    wall, parts = _parts(state, "m", t0 + 3.0)  # read 1 s after the later rank's first mark
    assert parts["startup"] == pytest.approx(2.0, abs=0.1) and parts["productive"] == pytest.approx(1.0, abs=0.1)
    assert abs(sum(parts.values()) - wall) < 1e-9


RESTART_ONCE = """
import os, sys, time, numpy as np, axond
axond.init_process_group()
if os.environ["AXOND_GENERATION"] == "1":
    time.sleep(1.0)
    sys.exit(3)  # the injected failure, before any collective: the job restarts once
x = np.ones(4)
for _ in range(200):  # the same count on every rank: none leaves while the other still reduces
    axond.all_reduce(x)
    time.sleep(0.01)
"""
RUN_S = 200 * 0.01 * 1.5
"""About how long the second generation runs its collectives (sleeps, and the all_reduces): the most that can be
productive."""


@pytest.mark.timeout(180)
def test_goodput_of_a_job_with_one_restart_reconciles_with_its_wall_time(
        coordinator_factory: Callable[..., RunningCoordinator], procs: Procs) -> None:
    coord = coordinator_factory(**FAST, metrics_port=0)
    client = connect(coord.address)
    job = "goodput"
    seen: list[tuple[float, pb.JobStatus | None]] = []

    def look() -> pb.JobStatus | None:
        found = next((j for j in client.get_status("", all=True).jobs if j.job == job), None)
        seen.append((time.monotonic(), found))
        return found

    try:
        worker = procs.axond("worker", "--coordinator", coord.address, "--job", job, "--max-restarts", "1",
                             "--nproc-per-node", "2", "--", PY, "-c", RESTART_ONCE)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            status = look()
            if status is not None and status.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED):
                break
            time.sleep(0.01)
        done = procs.finish(worker, timeout=60)
        assert done.code == 0, (seen[-1][1], done.stderr[-3000:])
        final = seen[-1][1]
        assert final is not None and final.state == pb.JOB_STATE_SUCCEEDED and final.restarts == 1
        parts = {p.cause: p.seconds for p in final.goodput}
        assert sum(parts.values()) == pytest.approx(final.wall_s, rel=0.01)
        assert 0 < parts["productive"] <= RUN_S, "only the ranks' collectives, not their start-up, are productive"
        assert parts["startup"] >= 1.0, "the first generation's ranks never ran a collective: start-up"
        assert parts["reformation"] > 0 and parts["hung"] == 0.0
        # the wall time as the test saw it: the job appeared between two looks and succeeded between two others
        first = next(i for i, (_, s) in enumerate(seen) if s is not None)
        last = next(i for i, (_, s) in enumerate(seen) if s is not None and s.state == pb.JOB_STATE_SUCCEEDED)
        shortest = seen[last - 1][0] - seen[first][0]
        longest = seen[last][0] - seen[first - 1][0] if first > 0 else seen[last][0] - seen[0][0] + 1.0
        assert shortest * 0.99 <= sum(parts.values()) <= longest * 1.01, (shortest, parts, longest)
        assert coord.metrics is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{coord.metrics.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert f'axond_job_time_seconds_total{{job="{job}",cause="productive"}}' in text
        assert f'axond_job_wall_seconds{{job="{job}"}}' in text and f'axond_job_goodput_ratio{{job="{job}"}}' in text
        res = procs.run("status", "--coordinator", coord.address, "--all")
        assert "GOODPUT (1)" in res.stdout and "REFORMATION" in res.stdout, res.stdout
    finally:
        client.close()
