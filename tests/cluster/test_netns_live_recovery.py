"""Live recovery across network hosts: a coordinator and four `axond worker --live-recovery` hosts in their own
network namespaces, one rank each, DistributedTrainer (ddp) with no checkpoint directory; while the others wait in
the next step's all_gather, rank 2 is SIGKILLed, or its host's link drops every frame both ways (nothing closes: its
peers' sockets get no EOF), or its worker daemon is stopped (SIGSTOP: its rank runs on, its lease does not). The
three survivors go on at world size 3 in the same processes, and the parameters after every step equal those of one
process training the same four virtual ranks.

Needs root and `ip netns` (skipped otherwise, with the reason).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from axond.fencing import fence_wait
from axond.testing import run_threads
from axond.testing.netns import Network
from live_train import Hashes, build_trainer
from netns import Proc, netns  # noqa: F401 - netns is the fixture
from netns_live import start_live_job

pytestmark = pytest.mark.slow  # a job across five network-namespace hosts (real coordinator and workers)

JOB = "live"
HEARTBEAT_S, MISSED = 0.25, 16
LEASE_S = HEARTBEAT_S * MISSED
CUT_MISSED, FENCE_MARGIN_S = 6, 0.5
CUT_LEASE_S = HEARTBEAT_S * CUT_MISSED
"""A cut link is found by the lease alone: a short one (1.5 s) keeps the test short."""
DETECT_S = 0.5
"""What live recovery promises beyond the lease for a cut link: the coordinator's tick (half an interval at most)
and the survivors' next heartbeat (an interval), then the rank's watcher (`live_watch.WATCH_S`)."""
HANG_STEP, STEPS = 20, 45
"""Rank 2 stops after step 20; 240 samples over 4 virtual ranks at batch 4 make 15 steps an epoch, 3 epochs."""


def start_job(net: Network, tmp_path: Path, missed: int, fence_margin: float = 1.0,
              parallel: str = "ddp") -> tuple[list[Proc], Path]:
    """A coordinator in host 0 and a live job of one rank on each other host; returns the workers and the out dir."""
    private = tmp_path / "tmp"  # the workers' temporary files (membership notes) in the test's own directory
    private.mkdir()
    job = start_live_job(net, tmp_path, JOB, HANG_STEP, HEARTBEAT_S, missed, fence_margin,
                         LIVE_TEST_PARALLEL=parallel, TMPDIR=str(private))
    return job.workers, job.out


def wait_for_hang(workers: list[Proc], out: Path) -> int:
    """The pid of rank 2 once it finished step HANG_STEP (the others then wait for it in the next all_gather)."""
    deadline = time.monotonic() + 90
    while not any(out.glob("hang-*")):
        assert time.monotonic() < deadline, [w.text()[-2000:] for w in workers]
        time.sleep(0.02)
    return int(next(out.glob("hang-*")).name.removeprefix("hang-"))


def check_survivors(out: Path, parallel: str = "ddp") -> list[dict[str, Any]]:
    """Three survivors in their first processes, every step's parameters bit for bit those of an uninterrupted run;
    returns each survivor's one recovery."""
    reference = Hashes()
    run_threads(lambda g: build_trainer(g, [reference] if g.rank == 0 else [], virtual_ranks=4,
                                        parallel=parallel).fit(3), 1, 120.0)
    assert len(reference.hashes) == STEPS
    ends = [json.loads(p.read_text()) for p in out.glob("end-*.json")]
    assert sorted(e["rank"] for e in ends) == [0, 1, 2] and all(e["world"] == 3 for e in ends)
    starts = list(out.glob("start-*"))
    assert len(starts) == 4  # four processes ever: the survivors kept theirs
    recoveries = []
    for end in ends:
        (recovery,) = end["recoveries"]
        assert end.get("relayed", False) == (parallel != "ddp")  # buddy copies through the workers' relays
        assert (recovery["world_before"], recovery["world_after"], recovery["step"]) == (4, 3, HANG_STEP)
        log = [json.loads(line) for line in (out / f"steps-{end['pid']}.jsonl").read_text().splitlines()]
        assert [s["step"] for s in log] == list(range(1, STEPS + 1))
        assert [s["hash"] for s in log] == reference.hashes  # every step's parameters, bit for bit
        recoveries.append(recovery)
    return recoveries


@pytest.mark.timeout(150)
@pytest.mark.parametrize("parallel", ["ddp", "zero", "fsdp"])
def test_four_hosts_lose_rank_two_and_the_rest_go_on_bit_identical(netns, tmp_path: Path, parallel: str) -> None:
    """Under ZeRO-1 and FSDP (on virtual ranks) rank 2's shard comes back from its buddy's copy in rank 3's memory,
    re-sharded over the three survivors: nothing read from storage (the job has no checkpoint directory)."""
    workers, out = start_job(netns(5), tmp_path, MISSED, parallel=parallel)
    victim = wait_for_hang(workers, out)
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    codes = [w.wait(60) for w in workers]
    assert sorted(codes)[:3] == [0, 0, 0] and sorted(codes)[3] != 0, [w.text()[-1500:] for w in workers]
    for recovery in check_survivors(out, parallel):
        assert recovery["reformed_at"] - killed < LEASE_S, recovery  # before the lease would have said "dead"
        assert recovery["checkpoint"] is None and recovery["from_copies"] == ([] if parallel == "ddp" else [2])
        print(f"{parallel}: error {recovery['error_at'] - killed:.2f} s, re-formed "
              f"{recovery['reformed_at'] - killed:.2f} s after the SIGKILL")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_four_hosts_lose_rank_twos_link_both_ways_and_the_rest_go_on_bit_identical(netns, tmp_path: Path,
                                                                                    parallel: str) -> None:
    net = netns(5)
    workers, out = start_job(net, tmp_path, CUT_MISSED, FENCE_MARGIN_S, parallel=parallel)
    victim = wait_for_hang(workers, out)
    (host,) = [h for h in net.hosts if victim in h.pids()]
    host.drop_frames(True)  # no FIN, no reset: the survivors' sockets to it stay open and silent
    dropped = time.monotonic()
    cut = next(w for w in workers if w.host is host)
    survivors = [w for w in workers if w is not cut]
    codes = [w.wait(60) for w in survivors]
    assert codes == [0, 0, 0], [w.text()[-1500:] for w in survivors]
    assert cut.wait(60) != 0, cut.text()[-1500:]  # its worker lost its lease and stopped its rank (the fence)
    fence = fence_wait(CUT_LEASE_S, HEARTBEAT_S, FENCE_MARGIN_S)
    for recovery in check_survivors(out, parallel):
        assert "missed" in recovery["reason"] and host.hostname in recovery["reason"], recovery
        assert recovery["from_copies"] == ([] if parallel == "ddp" else [2]), recovery
        # the cut collective raised once the lease ran out, not at the group's timeout (GROUP_TIMEOUT_S)
        assert recovery["error_at"] - dropped < CUT_LEASE_S + DETECT_S + HEARTBEAT_S, (recovery, dropped)
        # and computed again once the fence let the next generation start
        assert recovery["reformed_at"] - dropped < CUT_LEASE_S + DETECT_S + fence + 2.0, (recovery, dropped)


@pytest.mark.timeout(150)
def test_four_hosts_lose_rank_twos_frozen_worker_and_the_rest_go_on_bit_identical(netns, tmp_path: Path) -> None:
    workers, out = start_job(netns(5), tmp_path, CUT_MISSED, FENCE_MARGIN_S)
    victim = wait_for_hang(workers, out)
    frozen = next(w for w in workers if victim in w.host.pids())
    os.kill(frozen.popen.pid, signal.SIGSTOP)  # the daemon stops heartbeating; its rank keeps running
    stopped = time.monotonic()
    try:
        survivors = [w for w in workers if w is not frozen]
        codes = [w.wait(60) for w in survivors]
        assert codes == [0, 0, 0], [w.text()[-1500:] for w in survivors]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen.popen.pid, signal.SIGCONT)
    assert frozen.wait(60) != 0, frozen.text()[-1500:]  # woken: its lease is gone, it stops its rank and exits
    assert not Path(f"/proc/{victim}").exists()
    fence = fence_wait(CUT_LEASE_S, HEARTBEAT_S, FENCE_MARGIN_S)
    for recovery in check_survivors(out):
        assert "missed" in recovery["reason"] and frozen.host.hostname in recovery["reason"], recovery
        assert recovery["error_at"] - stopped < CUT_LEASE_S + DETECT_S + HEARTBEAT_S, (recovery, stopped)
        assert recovery["reformed_at"] - stopped < CUT_LEASE_S + DETECT_S + fence + 2.0, (recovery, stopped)
