"""A launcher that talks: real workers and coordinators, real rank processes.

The failure line names the root cause (the oldest failure), waiting ranks are reported while they wait, refused
joins are refused at once and the waiting workers told, abandoned pending jobs end, `--standalone` says how to
reach its coordinator, torchrun's flag spellings work and torch's own rank prefix is not doubled.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from axond.cli.main import main
from axond.control.client import CoordinatorClient, connect
from axond.coordinator.server import RunningCoordinator
from axond.v1 import coordinator_pb2 as pb
from worker_support import Procs, coord, procs, wait_for  # noqa: F401

PY = sys.executable
REPEAT = int(os.environ.get("AXOND_TEST_REPEAT", "1"))
"""Runs of the root-cause test (an operator's many-run proof sets it higher)."""

ROOT_CAUSE = """
import atexit, time
import numpy as np
import axond
axond.init_process_group("tcp", timeout=30)
x = np.ones(2)
axond.all_reduce(x)
if axond.get_rank() == 1:
    atexit.register(time.sleep, 1.0)  # a slow teardown: the survivor exits first
    raise ValueError("bad batch on rank 1")
axond.all_reduce(x)
"""


def _job(client: CoordinatorClient, name: str) -> pb.JobStatus | None:
    return next((j for j in client.get_status("", all=True).jobs if j.job == name), None)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.slow  # many rank processes or deadlines waited out: the full run, not the quick loop
@pytest.mark.parametrize("run", range(REPEAT))
def test_the_failure_line_names_the_root_cause_not_the_first_exit(procs: Procs, run: int) -> None:
    res = procs.run("worker", "--standalone", "--nproc-per-node", "2", "--stop-grace", "3", "--", PY, "-c", ROOT_CAUSE)
    assert res.code == 1, res.stderr
    assert re.fullmatch(r"axond worker: job 'default' failed: rank 1 \(\S+, pid \d+\) exited with code 1: "
                        r"ValueError: bad batch on rank 1 \(then rank 0 failed because of it\)", last_line(res.stderr)
                        ), res.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("run", range(REPEAT))
def test_every_node_names_the_root_cause_on_another_node(coord: RunningCoordinator, procs: Procs, run: int) -> None:
    args = ["worker", "--coordinator", coord.address, "--job", f"cause2-{run}", "--nnodes", "2", "--stop-grace", "3",
            "--", PY, "-c", ROOT_CAUSE]
    a, b = procs.axond(*args), procs.axond(*args)
    for res in (procs.finish(a), procs.finish(b)):
        assert res.code == 1, res.stderr
        cause = r"failed: rank 1 .*exited with code 1: ValueError: bad batch on rank 1(;|$)"
        assert re.search(cause, last_line(res.stderr)), res.stderr[-3000:]


def _wait_for_go(go: Path) -> str:
    """Rank code that stays outside axond until the test creates `go` (bounded)."""
    return (f"import os, time\nend = time.monotonic() + 90\n"
            f"while not os.path.exists({str(go)!r}) and time.monotonic() < end:\n    time.sleep(0.05)\n")


def _run_until_said(procs: Procs, script: str, said: re.Pattern[str], go: Path) -> list[str]:
    """Run a --standalone job of two ranks (notices every second); once the worker's stderr has a line matching
    `said`, create `go`; the job must then exit 0. Returns the worker's stderr lines."""
    proc = procs.axond("worker", "--standalone", "--nproc-per-node", "2", "--", PY, "-c", script,
                       env={"AXOND_WAIT_NOTICE_S": "1"})
    lines: list[str] = []
    stream = proc.stderr
    assert stream is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(stream.readline, "")), daemon=True)
    reader.start()
    wait_for(lambda: any(said.search(line) for line in lines), 90, f"a worker line matching {said.pattern!r}")
    go.touch()
    assert proc.wait(timeout=90) == 0, "".join(lines)
    reader.join(timeout=10)
    return lines


@pytest.mark.slow
def test_a_rank_blocked_in_a_collective_is_reported_while_it_waits(procs: Procs, tmp_path: Path) -> None:
    """Rank 1 stays outside axond until the worker's notice has named rank 0's wait, then joins the all_reduce."""
    go = tmp_path / "go"
    script = ("import numpy as np, axond\naxond.init_process_group('tcp', timeout=24)\n"  # reported after 6 s
              f"if axond.get_rank() == 1:\n    exec({_wait_for_go(go)!r})\naxond.all_reduce(np.ones(2))\n")
    _run_until_said(procs, script, re.compile(
        r"^axond worker: job 'default': still waiting: rank 0 blocked in all_reduce on group 'world' for [\d.]+ s; "
        r"rank\(s\) 1 report no blocked op \(outside axond"), go)


@pytest.mark.slow
def test_ranks_that_exited_are_named_again_with_how_long_ago(procs: Procs, tmp_path: Path) -> None:
    """Rank 1 exits at once; rank 0 runs on until the worker has named rank 1's exit again, with how long ago."""
    go = tmp_path / "go"
    script = f"import os\nif os.environ['RANK'] == '0':\n    exec({_wait_for_go(go)!r})\n"
    lines = _run_until_said(procs, script, re.compile(
        r"still waiting: rank\(s\) 1 exited with code 0 \d+ s ago; rank\(s\) 0 still run, for \d+ s"), go)
    assert any("job 'default': rank(s) 1 exited with code 0 but rank(s) 0 still run" in line for line in lines), lines


@pytest.mark.slow
def test_a_worker_with_other_options_is_refused_and_the_waiting_one_told(coord: RunningCoordinator,
                                                                        procs: Procs) -> None:
    base = ["worker", "--coordinator", coord.address, "--job", "mixed"]
    first = procs.axond(*base, "--nnodes", "2", "--join-timeout", "11", "--", PY, "-c", "pass")
    client = connect(coord.address)
    try:
        wait_for(lambda: _job(client, "mixed") is not None, 30, "the first join")
        t0 = time.monotonic()
        other = procs.run(*base, "--nnodes", "3", "--", PY, "-c", "pass")
        assert other.code == 2 and time.monotonic() - t0 < 15, other.stderr  # refused: the usage code
        assert "refused this worker: job 'mixed' runs with nnodes 2:2" in last_line(other.stderr)
        assert "asks 3:3" in last_line(other.stderr)
        res = procs.finish(first, timeout=60)
        assert res.code == 4, res.stderr
        progress = re.findall(r"^axond worker: job 'mixed': 1/2 nodes joined.*$", res.stderr, re.M)
        assert len(progress) == 1, f"an unchanged line is not repeated every 5 s: {progress}"
        assert "[refused a worker on" in progress[0] and "it asked nnodes 3:3" in progress[0], progress
        job = _job(client, "mixed")
        assert job is not None and job.state == pb.JOB_STATE_CANCELLED, "no live node waits: the pending job ends"
        assert "no live node waits in its rendezvous" in job.reason
    finally:
        client.close()


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_a_running_job_with_all_its_nodes_refuses_another_worker(coord: RunningCoordinator, procs: Procs,
                                                                tmp_path: Path) -> None:
    go = tmp_path / "go"
    script = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
    base = ["worker", "--coordinator", coord.address, "--job", "full"]
    first = procs.axond(*base, "--", PY, "-c", script)
    client = connect(coord.address)
    try:
        wait_for(lambda: getattr(_job(client, "full"), "state", 0) == pb.JOB_STATE_RUNNING, 30,
                 "the job to run")
        t0 = time.monotonic()
        second = procs.run(*base, "--", PY, "-c", "pass")
        assert second.code == 2 and time.monotonic() - t0 < 15, second.stderr  # the usage code: its options
        tail = last_line(second.stderr)
        assert tail.startswith("axond worker: job 'full' refused this worker: job 'full' is running with all its 1 "
                               "node(s)"), second.stderr
        assert "not in a state that allows this" not in tail, "the coordinator's reason, not a generic one"
        other = procs.run(*base, "--nnodes", "2", "--", PY, "-c", "pass")
        assert other.code == 2, other.stderr
        assert "refused this worker: job 'full' runs with nnodes 1:1" in last_line(other.stderr), other.stderr
    finally:
        client.close()
        go.touch()
    assert procs.finish(first).code == 0


@pytest.mark.slow
def test_standalone_says_how_to_reach_its_coordinator(procs: Procs, tmp_path: Path) -> None:
    go = tmp_path / "go"
    script = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
    proc = procs.axond("worker", "--standalone", "--nproc_per_node", "2", "--", PY, "-c", script)
    assert proc.stderr is not None
    seen = []
    found = None
    while found is None and len(seen) < 20:
        seen.append(proc.stderr.readline())
        found = re.search(r"see the job with: (axond status .*)$", seen[-1])
    assert found, seen
    wait_for(lambda: "running" in procs.run(*found.group(1).split()[1:]).stdout, 30, "the job to run")
    status = procs.run(*found.group(1).split()[1:])
    go.touch()
    assert status.code == 0, status.stderr
    assert re.search(r"^default\s+running", status.stdout, re.M), status.stdout
    assert procs.finish(proc).code == 0


RECORDED = """
import os
from torch.distributed.elastic.multiprocessing.errors import record
r = os.environ["RANK"]
print(f"[rank{r}]: from torch", flush=True)
print("plain", flush=True)

@record
def main():
    if r == "1":
        raise RuntimeError("first line\\nsecond line")

main()
"""


@pytest.mark.slow
def test_torchrun_spellings_prefixes_and_torch_error_files(procs: Procs) -> None:
    """torchrun's flag names; torch's `[rankN]:` prefix kept single; torch's `@record` error file is the cause."""
    pytest.importorskip("torch")
    res = procs.run("worker", "--standalone", "--nproc_per_node", "2", "--max_restarts", "0", "--node_rank", "0",
                    "--rdzv_id", "spelled", "--", PY, "-c", RECORDED)
    assert res.code == 1, res.stderr
    lines = res.stdout.splitlines()
    for rank in (0, 1):
        assert f"[rank{rank}]: from torch" in lines and f"[rank {rank}] plain" in lines, lines
    assert "[rank 0] [rank0]:" not in res.stdout
    assert "job 'spelled' generation 1" in res.stderr
    assert last_line(res.stderr).endswith("exited with code 1: RuntimeError: first line second line"), res.stderr


def test_every_command_shows_an_example_and_a_missing_coordinator_mentions_standalone() -> None:
    runner = CliRunner()
    for command in ([], ["coordinator"], ["worker"], ["run"], ["status"], ["health"]):
        out = runner.invoke(main, [*command, "--help"]).output
        assert re.search(r"Examples:\n +axond ", out), (command, out)
    res = runner.invoke(main, ["worker", "--", "true"], env={"AXOND_COORDINATOR": ""})
    assert res.exit_code == 2 and "--standalone" in res.output, res.output
