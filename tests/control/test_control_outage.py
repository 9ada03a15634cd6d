"""2-node jobs outlive coordinator outages: a SIGSTOP longer than the lease, then kill -9 and a restart.

Real processes on loopback: `axond coordinator` with a durable state directory and a 1 s lease (0.2 s
heartbeats x 5), two `axond worker`s of one rank each per job running tests/helpers/control_job.py, which all-reduces
until the test creates its done file. The collectives never need the coordinator, so neither outage may
stop them: the workers ride it out (each sees the other lost the coordinator too), the coordinator
counts none of the time it was away against their leases, the job stays in generation 1 and both
workers exit 0. CONTROL_OUTAGE_PAUSE (seconds, default 3.5 leases) sets how long each outage lasts,
CONTROL_OUTAGE_HEARTBEAT the heartbeat interval (default 0.2 s; the lease is 5 of them).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from control_procs import AXOND, HERE, TOKEN, Procs, free_port, procs  # noqa: F401 - procs is the fixture

pytestmark = pytest.mark.slow  # coordinator outages of several leases under real workers

HEARTBEAT = float(os.environ.get("CONTROL_OUTAGE_HEARTBEAT", "0.2"))
MISSED = 5
LEASE = HEARTBEAT * MISSED
PAUSE = float(os.environ.get("CONTROL_OUTAGE_PAUSE", str(3.5 * LEASE)))
JOB = "outage"


def _status(procs: Procs, port: int) -> str:
    out = procs.axond("status", "--coordinator", f"127.0.0.1:{port}", "--token", TOKEN, "--all")
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.timeout(120)
def test_two_node_jobs_run_through_a_coordinator_pause_and_a_kill_9_restart(procs: Procs, tmp_path: Path) -> None:
    """Two jobs at once under the same outages: one allowed no restart (one would fail it), one allowed a restart
    (one would pass but for its generation)."""
    port = free_port()
    flags = ("--heartbeat-interval", str(HEARTBEAT), "--dead-after-missed", str(MISSED),
             "--state-dir", str(tmp_path / "state"))
    coordinator = procs.coordinator("coordinator", port, *flags)
    done = tmp_path / "done"
    env = {"CONTROL_DONE_FILE": str(done), "CONTROL_TIMEOUT": "100"}
    jobs = {f"{JOB}{max_restarts}": max_restarts for max_restarts in (0, 1)}
    workers = [
        procs.worker(f"{job}-worker{i}", port, "--nnodes", "2", "--job", job, "--max-restarts", str(max_restarts),
                     "--outage-grace", "60", "--stop-grace", "1", cmd=[sys.executable, str(HERE / "control_job.py")],
                     env=env)
        for job, max_restarts in jobs.items() for i in range(2)
    ]
    for w in workers:
        w.wait_for("CONTROL-READY", timeout=60)

    # 1. The coordinator stopped (SIGSTOP) for several leases: every worker rides it out.
    coordinator.popen.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    for w in workers:
        w.wait_for("the coordinator is away", timeout=LEASE + 10)
    time.sleep(max(0.0, PAUSE - (time.monotonic() - stopped)))
    coordinator.popen.send_signal(signal.SIGCONT)
    for w in workers:
        w.wait_for("the coordinator answers again", timeout=10 * LEASE)
    coordinator.wait_for("were re-armed", timeout=10)
    status = _status(procs, port)
    assert "dead" not in status and "restarting" not in status, status

    # 2. kill -9, and a restart from the same state directory several leases later.
    coordinator.popen.kill()
    coordinator.popen.wait(10)
    killed = time.monotonic()
    for w in workers:
        w.wait_for("the coordinator is away", timeout=LEASE + 10, times=2)
    time.sleep(max(0.0, PAUSE - (time.monotonic() - killed)))
    procs.coordinator("coordinator2", port, *flags)
    for w in workers:
        w.wait_for("the coordinator answers again", timeout=10 * LEASE, times=2)

    done.touch()
    for w in workers:
        assert w.wait(60) == 0, w.text()
        out = w.text()
        assert "CONTROL-DONE" in out and "generation=1" in out, out
        assert "CONTROL-READY rank=0 generation=2" not in out and "re-joining" not in out, out
    status = _status(procs, port)
    for job in jobs:
        assert re.search(rf"^{job}\s+succeeded", status, re.M), status


@pytest.mark.timeout(90)
def test_a_job_rides_out_an_outage_only_for_the_outage_grace(procs: Procs, tmp_path: Path) -> None:
    """A two-node job whose coordinator is killed and not restarted: each worker's peer lost it too, so both ride it
    out, but only for --outage-grace, then stop their ranks and exit 3."""
    port = free_port()
    coordinator = procs.coordinator("coordinator", port, "--heartbeat-interval", str(HEARTBEAT),
                                    "--dead-after-missed", str(MISSED), "--in-memory")
    grace = 3 * LEASE
    workers = [procs.worker(f"worker{i}", port, "--nnodes", "2", "--job", JOB, "--outage-grace", str(grace),
                            "--stop-grace", "1", cmd=[sys.executable, str(HERE / "control_job.py")],
                            env={"CONTROL_DONE_FILE": str(tmp_path / "never"), "CONTROL_TIMEOUT": "100"})
               for i in range(2)]
    for w in workers:
        w.wait_for("CONTROL-READY", timeout=60)
    coordinator.popen.kill()
    killed = time.monotonic()
    for w in workers:
        w.wait_for("the coordinator is away (1 of the job's other nodes lost it too)", timeout=LEASE + 10)
    for w in workers:
        assert w.wait(grace + 20) == 3, w.text()
        # The grace runs from the last answered heartbeat, up to one interval before the kill.
        took = time.monotonic() - killed
        assert took >= grace - 2 * HEARTBEAT, (took, w.text())
    # The first to reach its grace stops for it; the other may find that peer gone a moment before its own grace
    # ends, and stop for that (its peer no longer vouches for the outage), or see its rank fail on the stopped peer
    # and find no coordinator to tell: the same exit, any of these reasons.
    texts = [w.text() for w in workers]
    assert any("longer than the outage grace" in t for t in texts), texts
    assert all(any(why in t for why in ("longer than the outage grace", "does not answer", "was not told"))
               for t in texts), texts


@pytest.mark.timeout(60)
def test_a_one_node_job_stops_at_the_lease_whatever_the_coordinators_address_answers(procs: Procs,
                                                                                     tmp_path: Path) -> None:
    """A one-node job has no peer to vouch that the coordinator itself is away: its address refusing connections
    (as a firewall's REJECT does too) proves nothing, so the worker stops its ranks by the end of its lease and
    exits 3, saying why."""
    port = free_port()
    coordinator = procs.coordinator("coordinator", port, "--heartbeat-interval", str(HEARTBEAT),
                                    "--dead-after-missed", str(MISSED), "--in-memory")
    worker = procs.worker("worker", port, "--job", JOB, "--outage-grace", "60", "--stop-grace", "1",
                          cmd=[sys.executable, str(HERE / "control_job.py")],
                          env={"CONTROL_DONE_FILE": str(tmp_path / "never"), "CONTROL_TIMEOUT": "100"})
    worker.wait_for("CONTROL-READY", timeout=60)
    coordinator.popen.kill()
    assert worker.wait(LEASE + 20) == 3, worker.text()
    assert "no other node of the job can vouch" in worker.text(), worker.text()


@pytest.mark.timeout(120)
def test_a_submitted_job_and_its_axond_run_outlive_a_coordinator_restart(procs: Procs, tmp_path: Path) -> None:
    """Daemon mode: `axond run` on two worker daemons; the coordinator is killed and restarted several leases
    later. The daemons ride it out, `axond run` follows the job's events again (none repeated) and exits 0."""
    port = free_port()
    flags = ("--heartbeat-interval", str(HEARTBEAT), "--dead-after-missed", str(MISSED),
             "--state-dir", str(tmp_path / "state"))
    coordinator = procs.coordinator("coordinator", port, *flags)
    daemons = [procs.start(f"daemon{i}", [*AXOND, "worker", "--coordinator", f"127.0.0.1:{port}", "--token", TOKEN,
                                          "--slots", "1", "--outage-grace", "60"]) for i in range(2)]
    for d in daemons:
        d.wait_for("registered as node", timeout=30)
    done = tmp_path / "done"
    run = procs.start("run", [*AXOND, "run", "--coordinator", f"127.0.0.1:{port}", "--token", TOKEN, "--nnodes", "2",
                              "--env", f"CONTROL_DONE_FILE={done}", "--", sys.executable, str(HERE / "control_job.py")])
    run.wait_for("CONTROL-READY", timeout=60, times=2)
    coordinator.popen.kill()
    coordinator.popen.wait(10)
    for d in daemons:
        d.wait_for("the coordinator is away", timeout=LEASE + 10)
    time.sleep(PAUSE)
    procs.coordinator("coordinator2", port, *flags)
    for d in daemons:
        d.wait_for("the coordinator answers again", timeout=10 * LEASE)
    done.touch()
    assert run.wait(60) == 0, run.text()
    out = run.text()
    assert out.count("CONTROL-READY") == 2 and out.count("CONTROL-DONE") == 2, out
