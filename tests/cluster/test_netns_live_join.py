"""Joining back across network hosts: a coordinator and four `axond worker --live-recovery --nnodes 3:4` hosts in their
own network namespaces, one rank each, DistributedTrainer (ddp) with no checkpoint directory. Rank 2 is SIGKILLed
(4 -> 3); then a replacement worker starts in the lost rank's host and joins the running job (3 -> 4): the survivors
keep their processes, the new rank takes the state from a live peer over the namespace links, and every step's
parameters equal those of one process training the same four virtual ranks.

Needs root and `ip netns` (skipped otherwise, with the reason).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from axond.testing import run_threads
from live_train import Hashes, build_trainer
from netns import Proc, netns  # noqa: F401 - netns is the fixture
from netns_live import start_live_job

pytestmark = pytest.mark.slow  # a job across five network-namespace hosts (real coordinator and workers)

JOB = "grow"
HEARTBEAT_S, MISSED = 0.25, 16
HANG_STEP, JOIN_STEP, STEPS = 20, 30, 45
"""Rank 2 stops after step 20; the three survivors wait after step 30 for the replacement; 15 steps an epoch, 3."""


@pytest.mark.timeout(200)
def test_a_replacement_host_joins_four_running_hosts_bit_identical(netns, tmp_path: Path) -> None:
    net = netns(5)
    job = start_live_job(net, tmp_path, JOB, HANG_STEP, HEARTBEAT_S, MISSED, LIVE_TEST_WAIT_JOIN=f"{JOIN_STEP}:4")
    workers, out, argv, env = job.workers, job.out, job.argv, job.env
    deadline = time.monotonic() + 90
    while not any(out.glob("hang-*")):
        assert time.monotonic() < deadline, [w.text()[-2000:] for w in workers]
        time.sleep(0.02)
    victim = int(next(out.glob("hang-*")).name.removeprefix("hang-"))
    os.kill(victim, signal.SIGKILL)
    while not any(w.popen.poll() is not None for w in workers):
        assert time.monotonic() < deadline + 30, [w.text()[-2000:] for w in workers]
        time.sleep(0.02)
    (lost,) = [w for w in workers if w.popen.poll() is not None]
    assert lost.wait(1) != 0 and "goes on without this node" in lost.text(), lost.text()[-1500:]
    replacement = Proc(lost.host, "replacement", argv, env, tmp_path)  # a new worker in the lost rank's host
    running = [w for w in workers if w is not lost] + [replacement]
    codes = [w.wait(90) for w in running]
    assert codes == [0, 0, 0, 0], [w.text()[-2000:] for w in running]
    assert "this node joined the running job live (a new node: no restart counted" in replacement.text()

    reference = Hashes()
    run_threads(lambda g: build_trainer(g, [reference], virtual_ranks=4).fit(3), 1, 120.0)
    assert len(reference.hashes) == STEPS
    ends = {e["pid"]: e for e in (json.loads(p.read_text()) for p in out.glob("end-*.json"))}
    assert len(ends) == 4 and all(e["world"] == 4 for e in ends.values())
    assert len(list(out.glob("start-*"))) == 5  # five processes ever: the survivors kept theirs, one new
    new = [pid for pid, e in ends.items() if e["transfers"][0]["received"]]
    assert len(new) == 1
    for pid, end in ends.items():
        log = [json.loads(line) for line in (out / f"steps-{pid}.jsonl").read_text().splitlines()]
        first = JOIN_STEP + 1 if pid in new else 1
        assert [s["step"] for s in log] == list(range(first, STEPS + 1))
        assert [s["hash"] for s in log] == reference.hashes[first - 1:]  # every step's parameters, bit for bit
        if pid not in new:
            moves = [(r["world_before"], r["world_after"], r["step"]) for r in end["recoveries"]]
            assert moves == [(4, 3, HANG_STEP), (3, 4, JOIN_STEP)], moves
    (got,) = ends[new[0]]["transfers"]
    print(f"\nstate transfer over the namespace links: {got['nbytes']} bytes in {got['seconds'] * 1e3:.1f} ms")
