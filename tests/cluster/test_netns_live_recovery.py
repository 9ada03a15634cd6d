"""Live recovery across network hosts: a coordinator and four `axond worker --live-recovery` hosts in their own
network namespaces, one rank each, DistributedTrainer (ddp) with no checkpoint directory; rank 2 is SIGKILLed while
the others wait in the next step's all_gather. The three survivors go on at world size 3 in the same processes, and
the parameters after every step equal those of one process training the same four virtual ranks.

Needs root and `ip netns` (skipped otherwise, with the reason).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from axond.testing import run_threads
from live_train import Hashes, build_trainer
from netns import AXOND, Proc, base_env, netns  # noqa: F401 - netns is the fixture

pytestmark = pytest.mark.slow  # a job across five network-namespace hosts (real coordinator and workers)

HERE = Path(__file__).resolve().parents[1] / "helpers"
TOKEN, PORT, JOB = "netns-live-token", 29500, "live"
HEARTBEAT_S, MISSED = 0.25, 16
LEASE_S = HEARTBEAT_S * MISSED
HANG_STEP, STEPS = 20, 45
"""Rank 2 stops after step 20; 240 samples over 4 virtual ranks at batch 4 make 15 steps an epoch, 3 epochs."""


@pytest.mark.timeout(150)
def test_four_hosts_lose_rank_two_and_the_rest_go_on_bit_identical(netns, tmp_path: Path) -> None:
    net = netns(5)
    env = base_env(tmp_path / "home")
    h0, *hosts = net.hosts
    coordinator = Proc(h0, "coordinator", [*AXOND, "coordinator", "--host", h0.addr, "--port", str(PORT), "--token",
                                           TOKEN, "--heartbeat-interval", str(HEARTBEAT_S), "--dead-after-missed",
                                           str(MISSED), "--settle-time", "10"], env, tmp_path)
    coordinator.wait_for("listening on", timeout=20)
    out = tmp_path / "out"
    out.mkdir()
    argv = [*AXOND, "worker", "--coordinator", f"{h0.addr}:{PORT}", "--token", TOKEN, "--nnodes", "3:4", "--job",
            JOB, "--live-recovery", "--join-timeout", "60", "--", sys.executable, str(HERE / "live_train.py"),
            str(out), str(HANG_STEP)]
    workers = [Proc(h, f"worker{h.index}", argv, env, tmp_path) for h in hosts]
    deadline = time.monotonic() + 90
    while not any(out.glob("hang-*")):
        assert time.monotonic() < deadline, [w.text()[-2000:] for w in workers]
        time.sleep(0.02)
    victim = int(next(out.glob("hang-*")).name.removeprefix("hang-"))
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    codes = [w.wait(60) for w in workers]
    assert sorted(codes)[:3] == [0, 0, 0] and sorted(codes)[3] != 0, [w.text()[-1500:] for w in workers]

    reference = Hashes()
    run_threads(lambda g: build_trainer(g, [reference] if g.rank == 0 else [], virtual_ranks=4).fit(3), 1, 120.0)
    assert len(reference.hashes) == STEPS
    ends = [json.loads(p.read_text()) for p in out.glob("end-*.json")]
    assert sorted(e["rank"] for e in ends) == [0, 1, 2] and all(e["world"] == 3 for e in ends)
    starts = list(out.glob("start-*"))
    assert len(starts) == 4  # four processes ever: the survivors kept theirs
    for end in ends:
        (recovery,) = end["recoveries"]
        assert (recovery["world_before"], recovery["world_after"], recovery["step"]) == (4, 3, HANG_STEP)
        assert recovery["reformed_at"] - killed < LEASE_S, recovery  # before the lease would have said "dead"
        log = [json.loads(line) for line in (out / f"steps-{end['pid']}.jsonl").read_text().splitlines()]
        assert [s["step"] for s in log] == list(range(1, STEPS + 1))
        assert [s["hash"] for s in log] == reference.hashes  # every step's parameters, bit for bit
