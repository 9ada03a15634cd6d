"""The `axond` CLI as users run it: real subprocesses against a real coordinator."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from axond.control.client import connect

from axond.coordinator.server import RunningCoordinator
from worker_support import (  # noqa: F401
    ENV_SCRIPT, FAST, Procs, coord, free_port, pid_alive, procs, self_signed, wait_for,
)

PY = sys.executable


@pytest.fixture
def token_coord(coordinator_factory: Callable[..., RunningCoordinator]) -> RunningCoordinator:
    return coordinator_factory(token="s3cret", **FAST)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_health_exit_codes(coord: RunningCoordinator, procs: Procs) -> None:
    ok = procs.run("health", "--coordinator", coord.address)
    assert ok.code == 0, ok.stderr
    down = procs.run("health", "--coordinator", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert down.code == 3, "unreachable: the same code as every other command"
    assert "Traceback" not in down.stderr and "axond coordinator" in down.stderr


@pytest.mark.slow
def test_unreachable_coordinator_says_what_to_do(procs: Procs) -> None:
    address = f"127.0.0.1:{free_port()}"
    commands = (
        ("status", "--coordinator", address),
        ("worker", "--coordinator", address, "--", PY, "-c", "pass"),
        ("run", "--coordinator", address, "--nnodes", "1", "--", PY, "-c", "pass"),
    )
    started = [(args, procs.axond(*args, env={"AXOND_CONNECT_TIMEOUT": "1"})) for args in commands]  # at once
    for args, proc in started:
        res = procs.finish(proc, timeout=60)
        assert res.code == 3, (args, res.stderr)
        assert f"waiting for the coordinator at {address} (not reachable yet; up to 1 s)" in res.stderr
        assert f"is `axond coordinator` running at {address}?" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_wrong_token_is_refused_and_the_right_one_works(token_coord: RunningCoordinator, procs: Procs) -> None:
    bad = procs.run("status", "--coordinator", token_coord.address, "--token", "nope")
    assert bad.code == 3
    assert "refused the token" in bad.stderr and "--token" in bad.stderr and "Traceback" not in bad.stderr
    missing = procs.run("worker", "--coordinator", token_coord.address, "--", PY, "-c", "pass")
    assert missing.code == 3 and "refused the token" in missing.stderr
    good = procs.run(
        "worker", "--coordinator", token_coord.address, "--job", "tok", "--", PY, "-c", ENV_SCRIPT,
        env={"AXOND_TOKEN": "s3cret"},
    )
    assert good.code == 0, good.stderr
    assert good.env_lines()[0]["AXOND_TOKEN"] == "s3cret", "ranks get the token to reach the coordinator"
    assert procs.run("health", "--coordinator", token_coord.address, "--token", "s3cret").code == 0


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_coordinator_address_from_the_environment(coord: RunningCoordinator, procs: Procs) -> None:
    res = procs.run("status", env={"AXOND_COORDINATOR": coord.address})
    assert res.code == 0, res.stderr
    missing = procs.run("run", "--", PY, "-c", "pass")
    assert missing.code == 2 and "--coordinator" in missing.stderr
    local = procs.run("status", "--connect-timeout", "0")  # status asks this machine's 127.0.0.1:29500 instead
    assert local.code in (0, 3) and (local.code == 0 or "127.0.0.1:29500" in local.stderr), local.stderr


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize(
    "args, expect",
    [
        (("--nnodes", "3:1"), "MIN <= MAX"),
        (("--nnodes", "two"), "N or MIN:MAX"),
        (("--nproc-per-node", "0"), "nproc-per-node"),
    ],
)
def test_worker_usage_errors(procs: Procs, args: tuple[str, ...], expect: str) -> None:
    res = procs.run("worker", "--coordinator", "127.0.0.1:1", *args, "--", PY, "-c", "pass")
    assert res.code == 2 and expect in res.stderr, res.stderr


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_daemon_mode_refuses_agent_flags(procs: Procs) -> None:
    res = procs.run("worker", "--coordinator", "127.0.0.1:1", "--nnodes", "2")
    assert res.code == 2 and "daemon mode" in res.stderr
    res = procs.run("worker", "--coordinator", "127.0.0.1:1", "--slots", "2", "--", PY, "-c", "pass")
    assert res.code == 2 and "--slots" in res.stderr


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_status_shows_nodes_jobs_and_ranks(coord: RunningCoordinator, procs: Procs, tmp_path: Path) -> None:
    script = (
        "import os, time, pathlib\n"
        f"pathlib.Path({str(tmp_path)!r}, os.environ['RANK']).touch()\n"
        "time.sleep(60)\n"
    )
    procs.axond("worker", "--coordinator", coord.address, "--job", "shown", "--nproc-per-node", "2",
                "--", PY, "-c", script)
    wait_for(lambda: len(list(tmp_path.iterdir())) == 2, 30, "the ranks to start")
    res = procs.run("status", "--coordinator", coord.address)
    assert res.code == 0, res.stderr
    text = res.stdout
    assert "NODES (1)" in text and "JOBS (1)" in text and "RANKS (2)" in text
    assert re.search(r"^shown\s+running\s+1\s+1\s+2\s+0/0", text, re.M), text
    assert re.search(r"^\S+\s+\S+\s+(alive|suspect)\s+\d+\.\ds\s+0\s+agent\s+shown$", text, re.M), text
    assert len(re.findall(r"^shown\s+[01]\s+\S+\s+\S+\s+\S+\s+0\s+[01]$", text, re.M)) == 2, text
    assert "HOST  PID" in text


@pytest.mark.slow
def test_status_of_a_hung_job_shows_which_rank_waits_in_which_op(coord: RunningCoordinator, procs: Procs,
                                                                 tmp_path: Path) -> None:
    """Rank 1 waits in an all_reduce that rank 0, stuck in its own code, never joins: `status --job` says so."""
    script = (
        "import os, pathlib, time, numpy as np, axond\n"
        "axond.init_process_group(timeout=12.0)\n"
        f"pathlib.Path({str(tmp_path)!r}, os.environ['RANK']).touch()\n"
        "if axond.get_rank() == 0:\n"
        "    time.sleep(60)\n"
        "axond.all_reduce(np.ones(3))\n"
    )
    procs.axond("worker", "--coordinator", coord.address, "--job", "hung", "--nproc-per-node", "2",
                "--", PY, "-c", script)
    # the ranks' start is not timed (slow on a busy machine); the report must come within rank 1's 12 s timeout
    wait_for(lambda: len(list(tmp_path.iterdir())) == 2, 60, "the ranks to start")
    seen: list[str] = []

    def rank_one_reported() -> bool:
        res = procs.run("status", "--coordinator", coord.address, "--job", "hung")
        seen.append(res.stdout + res.stderr)
        return res.code == 0 and re.search(r"^hung\s+1\s+.*all_reduce on group 'world' for \d+\.\d s$",
                                            res.stdout, re.M) is not None

    wait_for(rank_one_reported, 11, "rank 1's report (reports start after a quarter of the 12 s timeout)", 0.3)
    assert "BLOCKED IN" in seen[-1]
    assert re.search(r"^hung\s+0\s+\S+\s+\S+\s+\S+\s+0\s+0\s+-\s+-$", seen[-1], re.M), seen[-1]  # no op, no straggler


def test_run_through_daemons_end_to_end(coord: RunningCoordinator, procs: Procs) -> None:
    for _ in range(2):
        procs.axond("worker", "--coordinator", coord.address, "--slots", "2")
    script = ENV_SCRIPT + "; import sys; print('to-err', file=sys.stderr)"
    res = procs.run("run", "--coordinator", coord.address, "--nnodes", "2", "--nproc-per-node", "2",
                    "--job", "e2e", "--", PY, "-c", script, timeout=60)
    assert res.code == 0, res.stderr
    envs = res.env_lines()
    assert sorted(envs) == [0, 1, 2, 3]
    assert {e["NODE_RANK"] for e in envs.values()} == {"0", "1"}
    assert all(e["WORLD_SIZE"] == "4" and e["AXOND_JOB"] == "e2e" for e in envs.values())
    assert sorted(line for line in res.stderr.splitlines() if line.endswith("to-err")) == [
        f"[rank {r}] to-err" for r in range(4)
    ]
    failing = procs.run("run", "--coordinator", coord.address, "--nnodes", "1", "--nproc-per-node", "2",
                        "--", PY, "-c", "import os, sys; sys.exit(4 if os.environ['RANK'] == '1' else 0)")
    assert failing.code == 1, "a rank's failure is exit code 1 (its own code 4 is in the message)"
    assert "rank 1" in failing.stderr and "exited with code 4" in failing.stderr
    line = failing.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"axond run: job '.*' failed: rank 1 \(.*, pid \d+\) exited with code 4; no restarts left "
                        r"\(max_restarts 0\)", line), f"the failure said once: {line}"


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_run_attach_follows_a_submitted_job(coord: RunningCoordinator, procs: Procs) -> None:
    procs.axond("worker", "--coordinator", coord.address, "--slots", "1")
    with connect(coord.address, call_timeout=5.0) as c:
        job = c.submit_job([PY, "-c", "print('from-the-rank')"], 1, 1, job="attach-me")
    res = procs.run("run", "--coordinator", coord.address, "--attach", job, timeout=60)
    assert res.code == 0, res.stderr
    assert "[rank 0] from-the-rank" in res.stdout
    again = procs.run("run", "--coordinator", coord.address, "--attach", job, timeout=30)
    assert again.code == 0 and "[rank 0] from-the-rank" in again.stdout, "a finished job replays from its start"
    usage = procs.run("run", "--coordinator", coord.address, "--attach", job, "--nnodes", "1", "--", PY)
    assert usage.code == 2 and "--attach" in usage.stderr


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_run_ctrl_c_cancels_the_job(coord: RunningCoordinator, procs: Procs, tmp_path: Path) -> None:
    procs.axond("worker", "--coordinator", coord.address, "--slots", "1")
    script = (
        "import os, time, pathlib\n"
        f"pathlib.Path({str(tmp_path)!r}, 'pid').write_text(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    run = procs.axond("run", "--coordinator", coord.address, "--nnodes", "1", "--job", "cancel-me",
                      "--", PY, "-c", script)
    wait_for(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text() != "", 30, "the rank to start")
    rank_pid = int((tmp_path / "pid").read_text())
    os.kill(run.pid, signal.SIGINT)
    res = procs.finish(run, timeout=30)
    assert res.code == 130, res.stderr
    assert "cancel" in res.stderr
    wait_for(lambda: not pid_alive(rank_pid), 15, "the cancelled rank to be stopped")


@pytest.mark.slow
def test_coordinator_command_serves_and_stops_on_sigterm(procs: Procs) -> None:
    port = free_port()
    server = procs.axond("coordinator", "--host", "127.0.0.1", "--port", str(port))
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    with connect(address, call_timeout=2.0) as c:  # `axond health` has its own test: not an interpreter per look
        while not c.health(timeout=1.0):
            assert time.monotonic() < deadline and server.poll() is None, "the coordinator did not come up"
            time.sleep(0.2)
    server.send_signal(signal.SIGTERM)
    res = procs.finish(server, timeout=20)
    assert res.code == 0, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_tls_ca_and_token_reach_the_coordinator_and_the_ranks(
    coordinator_factory: Callable[..., RunningCoordinator], procs: Procs, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    c = coordinator_factory(tls_cert=cert, tls_key=key, token="t0k", **FAST)
    secure = ("--coordinator", c.address, "--token", "t0k", "--tls-ca", str(cert))
    res = procs.run("worker", *secure, "--job", "tls", "--", PY, "-c", ENV_SCRIPT)
    assert res.code == 0, res.stderr
    env = res.env_lines()[0]
    assert (env["AXOND_TLS_CA"], env["AXOND_TOKEN"]) == (str(cert), "t0k")
    assert procs.run("status", *secure).code == 0
    assert procs.run("health", *secure).code == 0
    plain = procs.run("status", "--coordinator", c.address, "--token", "t0k")
    assert plain.code == 3 and "--tls-ca" in plain.stderr
