"""Issue #17 "First contact", CLI and worker side: what a new user meets in the first minutes.

Real `axond` subprocesses against real coordinators on loopback: waiting for a coordinator that is
starting, rendezvous progress, the failing rank's cause in the worker's last line, one exit-code
table, address forms and a port already in use.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from axond.cli.main import main
from axond.cli.status_cmd import render_status
from axond.control.channel import normalize_address
from axond.coordinator.server import RunningCoordinator
from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb
from worker_support import Procs, coord, free_port, procs, wait_for  # noqa: F401

PY = sys.executable

WRITE_ERROR_FILE = (
    "import json, os, sys, time\n"
    "if os.environ['RANK'] == '1':\n"
    "    with open(os.environ['AXOND_ERROR_FILE'], 'w') as f:\n"
    "        json.dump({'rank': 1, 'type': 'ValueError', 'message': 'bad input', 'traceback': 'Traceback ...',\n"
    "                   'time': time.time()}, f)\n"
    "    print('ERRFILE ' + os.environ['AXOND_ERROR_FILE'], flush=True)\n"
    "    sys.exit(1)\n"
    "time.sleep(60)\n"
)
"""Rank 1 writes the error-file contract's JSON (as `axond.distributed` does on an uncaught exception) and exits 1."""


def worker(c: RunningCoordinator, job: str, *extra: str) -> list[str]:
    return ["worker", "--coordinator", c.address, "--job", job, "--stop-grace", "2", *extra]


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.mark.slow
def test_workers_started_before_the_coordinator_wait_for_it(procs: Procs, tmp_path: Path) -> None:
    """The Quick start pasted as written: the workers come first and must not exit 3."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    args = ("worker", "--coordinator", address, "--nnodes", "2", "--job", "demo", "--", PY, "-c", "print('hi')")
    a, b = procs.axond(*args), procs.axond(*args)
    time.sleep(1.5)
    server = procs.axond("coordinator", "--host", "127.0.0.1", "--port", str(port))
    ra, rb = procs.finish(a, timeout=60), procs.finish(b, timeout=60)
    assert (ra.code, rb.code) == (0, 0), (ra.stderr, rb.stderr)
    for res in (ra, rb):
        assert f"axond worker: waiting for the coordinator at {address} (not reachable yet; up to 30 s)" in res.stderr
        assert res.stderr.count("waiting for the coordinator") == 1, "one line, not one per retry"
    assert server.poll() is None


@pytest.mark.slow
def test_the_wait_for_the_coordinator_is_bounded(procs: Procs) -> None:
    t0 = time.monotonic()
    res = procs.run("status", "--coordinator", f"127.0.0.1:{free_port()}", "--connect-timeout", "2")
    assert res.code == 3, res.stderr
    assert time.monotonic() - t0 < 15
    assert "up to 2 s" in res.stderr and "is `axond coordinator` running at" in last_line(res.stderr)


@pytest.mark.slow
def test_a_lone_worker_says_how_far_the_rendezvous_got(coord: RunningCoordinator, procs: Procs) -> None:
    t0 = time.monotonic()
    res = procs.run(*worker(coord, "lone", "--nnodes", "2", "--join-timeout", "7"), "--", PY, "-c", "pass")
    assert res.code == 4, "the rendezvous timed out: exit code 4"
    progress = re.findall(r"^axond worker: job 'lone': 1/2 nodes joined.*; waiting for 1 more, up to (\d+) s$",
                          res.stderr, re.M)
    assert progress, res.stderr
    assert int(progress[0]) <= 3, "the first line comes after ~5 s of the 7 s"
    assert "did not complete within 7 s" in last_line(res.stderr)
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_a_rank_that_returned_early_is_named_while_the_others_run(coord: RunningCoordinator, procs: Procs) -> None:
    # the notice comes AXOND_WAIT_NOTICE_S (2 s here, else 5 s) after rank 1's exit; rank 0 runs 2 s longer
    script = "import os, time; time.sleep(4 if os.environ['RANK'] == '0' else 0)"
    res = procs.run(*worker(coord, "early", "--nproc-per-node", "2"), "--", PY, "-c", script,
                    env={"AXOND_WAIT_NOTICE_S": "2"})
    assert res.code == 0, res.stderr
    assert ("job 'early': rank(s) 1 exited with code 0 but rank(s) 0 still run; if those wait for them "
            "(init_process_group, a collective), they fail at their timeout") in res.stderr


def test_the_last_line_names_the_failing_rank_and_its_error(coord: RunningCoordinator, procs: Procs) -> None:
    res = procs.run(*worker(coord, "bad", "--nproc-per-node", "2"), "--", PY, "-c", WRITE_ERROR_FILE)
    assert res.code == 1, res.stderr
    host = socket.gethostname()
    assert re.fullmatch(
        rf"axond worker: job 'bad' failed: rank 1 \({re.escape(host)}, pid \d+\) exited with code 1: ValueError: bad input",
        last_line(res.stderr),
    ), res.stderr
    error_file = Path(re.findall(r"ERRFILE (\S+)", res.stdout)[0])
    assert not error_file.parent.exists(), "the worker removes its private error-file directory"


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_without_an_error_file_the_last_stderr_line_is_the_cause(coord: RunningCoordinator, procs: Procs) -> None:
    script = "import sys; print('disk quota exceeded', file=sys.stderr); sys.exit(3)"
    res = procs.run(*worker(coord, "nofile"), "--", PY, "-c", script)
    assert res.code == 1, res.stderr
    assert re.search(r"failed: rank 0 \(.*pid \d+\) exited with code 3: disk quota exceeded$", last_line(res.stderr))
    killed = procs.run(*worker(coord, "killed"), "--", PY, "-c", "import os; os.kill(os.getpid(), 9)")
    assert killed.code == 1
    assert re.search(r"exited with code 137 \(SIGKILL\)$", last_line(killed.stderr)), killed.stderr


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_the_other_node_names_the_failing_rank_too(coord: RunningCoordinator, procs: Procs) -> None:
    args = worker(coord, "two", "--nnodes", "2")
    a = procs.axond(*args, "--", PY, "-c", WRITE_ERROR_FILE)
    b = procs.axond(*args, "--", PY, "-c", WRITE_ERROR_FILE)
    ra, rb = procs.finish(a, timeout=60), procs.finish(b, timeout=60)
    assert (ra.code, rb.code) == (1, 1), (ra.stderr, rb.stderr)
    for res in (ra, rb):
        assert re.search(r"rank 1 \(\S+, pid \d+\) exited with code 1: ValueError: bad input", last_line(res.stderr))


@pytest.mark.slow
def test_a_node_whose_ranks_succeeded_fails_with_the_job(coord: RunningCoordinator, procs: Procs) -> None:
    """Each worker's exit code is the job's (what `docker compose up --exit-code-from worker-0` relies on)."""
    script = (
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(2); print('late failure', file=sys.stderr); sys.exit(6)\n"
    )
    args = worker(coord, "late", "--nnodes", "2")
    a, b = procs.axond(*args, "--", PY, "-c", script), procs.axond(*args, "--", PY, "-c", script)
    ra, rb = procs.finish(a, timeout=60), procs.finish(b, timeout=60)
    assert (ra.code, rb.code) == (1, 1), (ra.stderr, rb.stderr)
    for res in (ra, rb):
        assert re.search(r"rank 1 \(\S+, pid \d+\) exited with code 6: late failure", last_line(res.stderr)), res.stderr


@pytest.mark.slow
def test_exit_codes_do_not_collide(coord: RunningCoordinator, procs: Procs) -> None:
    unreachable = f"127.0.0.1:{free_port()}"
    cannot_reach = [(args, procs.axond(args[0], "--coordinator", unreachable, *args[1:]))  # all at once
                    for args in (("health", "--timeout", "1"), ("status", "--connect-timeout", "0"),
                                 ("worker", "--connect-timeout", "0", "--", PY, "-c", "pass"))]
    usage = procs.axond("worker", "--coordinator", coord.address, "--nnodes", "x", "--", PY, "-c", "pass")
    rank_two = procs.run(*worker(coord, "two-code"), "--", PY, "-c", "import sys; sys.exit(2)")
    assert rank_two.code == 1, "a rank's exit code 2 must not look like a usage error"
    assert "exited with code 2" in last_line(rank_two.stderr)
    assert procs.finish(usage).code == 2
    for args, proc in cannot_reach:
        res = procs.finish(proc)
        assert res.code == 3, (args, res.stderr)


@pytest.mark.parametrize("command", ["coordinator", "worker", "run", "status", "health"])
def test_every_command_documents_the_exit_codes(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"], prog_name="axond")
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    entries = {  # the codes each command can exit with (coordinator, status, health run no job)
        "coordinator": ("Exit codes: 0 stopped cleanly", "1 it cannot start", "2 usage error"),
        "status": ("Exit codes: 0 shown", "2 usage error", "3 cannot reach or authenticate"),
        "health": ("Exit codes: 0 SERVING", "2 usage error", "3 cannot reach or authenticate"),
    }.get(command, ("0 ok", "2 usage error", "3 cannot reach or authenticate", "4 the rendezvous timed out"))
    for entry in entries:
        assert entry in text, (command, entry)


@pytest.mark.slow  # many rank processes or deadlines waited out: the full run, not the quick loop
@pytest.mark.parametrize("given", ["http://{a}", "grpc://{a}", "{a}", "http://{a}/", " {a} "])
def test_coordinator_address_forms(coord: RunningCoordinator, procs: Procs, given: str) -> None:
    res = procs.run("status", "--coordinator", given.format(a=coord.address))
    assert res.code == 0, res.stderr


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("given, says", [
    ("http://127.0.0.1:1/path", "is not HOST:PORT"),
    ("https://127.0.0.1:1", "--tls-ca"),
    ("::1", "[::1]:29500"),
    ("127.0.0.1:99999", "no valid port"),
])
def test_bad_coordinator_addresses_are_usage_errors(procs: Procs, given: str, says: str) -> None:
    res = procs.run("status", "--coordinator", given)
    assert res.code == 2 and says in res.stderr, res.stderr
    assert "Misformatted" not in res.stderr


def test_normalize_address() -> None:
    assert normalize_address("HTTP://Host-1:80") == "Host-1:80"
    assert normalize_address("[::1]:5") == "[::1]:5" and normalize_address("[::1]") == "[::1]:29500"
    assert normalize_address("worker_0") == "worker_0:29500"
    for bad in ("http://", "a b:1", "user@h:1", "grpcs://h:1", "h:0"):
        with pytest.raises(CoordinatorError):
            normalize_address(bad)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_a_port_in_use_is_one_clear_line(procs: Procs) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = procs.run("coordinator", "--host", "127.0.0.1", "--port", str(port), timeout=30)
    assert res.code == 1
    assert res.stderr.splitlines() == [
        f"axond coordinator: cannot listen on 127.0.0.1:{port}: the port is in use (another coordinator?); "
        "stop that process or pass another --port"
    ]


def test_status_shows_host_pid_and_omitted_ranks() -> None:
    reply = pb.GetStatusResponse(jobs=[pb.JobStatus(
        job="big", state=pb.JOB_STATE_RUNNING, generation=1, world_size=3, nnodes=1, ranks_omitted=1,
        ranks=[pb.RankStatus(rank=0, node_id="n1", hostname="host-a", pid=4242),
               pb.RankStatus(rank=1, node_id="n1", local_rank=1, hostname="host-a")],
    )])
    text = render_status(reply)
    assert re.search(r"^big\s+0\s+n1\s+host-a\s+4242\s+0\s+0$", text, re.M), text
    assert re.search(r"^big\s+1\s+n1\s+host-a\s+-\s+0\s+1$", text, re.M), text
    assert text.endswith("1 ranks not shown")


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_status_all_and_rank_pids(coord: RunningCoordinator, procs: Procs, tmp_path: Path) -> None:
    script = (
        "import os, time, pathlib\n"
        f"pathlib.Path({str(tmp_path)!r}, os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    w = procs.axond(*worker(coord, "pids", "--nproc-per-node", "2"), "--", PY, "-c", script)
    wait_for(lambda: all((tmp_path / r).exists() and (tmp_path / r).read_text() for r in "01"), 30, "the ranks")
    res = procs.run("status", "--coordinator", coord.address, "--all")
    assert res.code == 0, res.stderr
    assert "RANKS (2)" in res.stdout
    for r in "01":
        row = re.search(rf"^pids\s+{r}\s+\S+\s+(\S+)\s+(\S+)\s+0\s+{r}$", res.stdout, re.M)
        assert row, res.stdout
        assert row.group(2) in ("-", (tmp_path / r).read_text()), "a rank's pid is the one its worker reported"
    os.kill(w.pid, signal.SIGTERM)
    assert procs.finish(w, timeout=30).code == 128 + signal.SIGTERM


def test_the_worker_reports_its_ranks_pids(tmp_path: Path) -> None:
    """What heartbeats carry as local_pids: each local rank's pid while it runs, 0 once it exited."""
    from axond.worker.launcher import RankSpec, start_ranks

    specs = [RankSpec(rank=r, local_rank=r, env=dict(os.environ)) for r in range(2)]
    ranks = start_ranks([PY, "-c", "import time; time.sleep(60)"], specs, sink=lambda *a: None)
    try:
        pids = ranks.local_pids()
        assert pids == ranks.pids and all(p > 0 for p in pids)
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: ranks.local_pids()[1] == 0, 10, "the killed rank to be reported as not running")
        assert ranks.local_pids()[0] == pids[0]
    finally:
        ranks.stop(grace=1)


def test_error_file_contract_is_read_as_written(tmp_path: Path) -> None:
    from axond.worker.launcher import read_error_file

    path = tmp_path / "e.json"
    path.write_text(json.dumps({"rank": 0, "type": "RuntimeError", "message": "line one\nline two",
                                "traceback": "...", "time": 1.0}))
    assert read_error_file(str(path)) == "RuntimeError: line one line two"
    path.write_text("{not json")
    assert read_error_file(str(path)) == "" and read_error_file(str(tmp_path / "missing")) == ""
