"""`axond worker -- CMD` against a real coordinator: rendezvous, rank env, failures and restarts."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from axond.control.client import connect
from axond.coordinator.server import RunningCoordinator
from axond.v1 import coordinator_pb2 as pb
from worker_support import ENV_SCRIPT, Procs, coord, pid_alive, procs, wait_for  # noqa: F401

PY = sys.executable


def worker_args(c: RunningCoordinator, job: str, *extra: str) -> list[str]:
    return ["worker", "--coordinator", c.address, "--job", job, "--stop-grace", "2", *extra]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_single_node_ranks_get_the_contract_environment(coord: RunningCoordinator, procs: Procs) -> None:
    res = procs.run(*worker_args(coord, "one", "--nproc-per-node", "2"), "--", PY, "-c", ENV_SCRIPT)
    assert res.code == 0, res.stderr
    envs = res.env_lines()
    assert sorted(envs) == [0, 1]
    for rank, env in envs.items():
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2" and env["NODE_RANK"] == "0"
        assert env["AXOND_JOB"] == "one" and env["AXOND_COORDINATOR"] == coord.address
        assert env["AXOND_GENERATION"] and int(env["AXOND_GENERATION"]) >= 1
        assert env["AXOND_JOB_SECRET"] and len(env["AXOND_JOB_SECRET"]) >= 16
        bytes.fromhex(env["AXOND_JOB_SECRET"])
        assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")  # torchrun's default for K > 1
    assert envs[0]["AXOND_JOB_SECRET"] == envs[1]["AXOND_JOB_SECRET"]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_two_nodes_get_unique_contiguous_ranks(coord: RunningCoordinator, procs: Procs) -> None:
    args = worker_args(coord, "two", "--nnodes", "2", "--nproc-per-node", "2")
    a = procs.axond(*args, "--", PY, "-c", ENV_SCRIPT)
    b = procs.axond(*args, "--", PY, "-c", ENV_SCRIPT)
    ra, rb = procs.finish(a), procs.finish(b)
    assert ra.code == 0 and rb.code == 0, (ra.stderr, rb.stderr)
    ea, eb = ra.env_lines(), rb.env_lines()
    assert sorted([*ea, *eb]) == [0, 1, 2, 3]
    for envs in (ea, eb):
        (node_rank,) = {e["NODE_RANK"] for e in envs.values()}
        ranks = sorted(envs)
        assert ranks == [2 * int(node_rank), 2 * int(node_rank) + 1], "each node holds a contiguous block"
        for rank, e in envs.items():
            assert e["RANK"] == str(rank)
            assert e["LOCAL_RANK"] == str(rank - ranks[0])
            assert e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "2"
    assert {e["NODE_RANK"] for e in [*ea.values(), *eb.values()]} == {"0", "1"}
    secrets = {e["AXOND_JOB_SECRET"] for e in [*ea.values(), *eb.values()]}
    generations = {e["AXOND_GENERATION"] for e in [*ea.values(), *eb.values()]}
    assert len(secrets) == 1 and len(generations) == 1


def test_the_first_failing_rank_is_named_with_its_code(coord: RunningCoordinator, procs: Procs) -> None:
    script = "import os, sys, time; r = int(os.environ['RANK']); sys.exit(7) if r == 1 else time.sleep(60)"
    t0 = time.monotonic()
    res = procs.run(*worker_args(coord, "fail1", "--nproc-per-node", "3"), "--", PY, "-c", script)
    assert res.code == 1, "a rank's failure is exit code 1, whatever the rank's own code"
    assert re.search(r"job 'fail1' failed: rank 1 \(\S+, pid \d+\) exited with code 7$", res.stderr.splitlines()[-1])
    assert time.monotonic() - t0 < 30, "the sleeping ranks must be stopped, not waited for"


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_output_is_prefixed_and_streams_kept_apart(coord: RunningCoordinator, procs: Procs) -> None:
    script = "import sys; print('to-out'); print('to-err', file=sys.stderr)"
    res = procs.run(*worker_args(coord, "streams", "--nproc-per-node", "2"), "--", PY, "-c", script)
    assert res.code == 0, res.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] to-out" in res.stdout.splitlines()
        assert f"[rank {rank}] to-err" in res.stderr.splitlines()
        assert f"[rank {rank}] to-err" not in res.stdout


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_a_failing_rank_stops_every_worker(coord: RunningCoordinator, procs: Procs, tmp_path: Path) -> None:
    script = (
        "import os, sys, time, pathlib\n"
        f"pathlib.Path({str(tmp_path)!r}, os.environ['RANK']).write_text(str(os.getpid()))\n"
        "if os.environ['RANK'] == '3':\n"
        "    time.sleep(0.5); sys.exit(5)\n"
        "time.sleep(120)\n"
    )
    args = worker_args(coord, "failing", "--nnodes", "2", "--nproc-per-node", "2")
    a = procs.axond(*args, "--", PY, "-c", script)
    b = procs.axond(*args, "--", PY, "-c", script)
    t0 = time.monotonic()
    ra, rb = procs.finish(a, timeout=40), procs.finish(b, timeout=40)
    elapsed = time.monotonic() - t0
    assert ra.code != 0 and rb.code != 0, (ra.stderr, rb.stderr)
    assert elapsed < 20, f"workers took {elapsed:.1f} s to stop"
    assert [ra.code, rb.code] == [1, 1], "a failed job is exit code 1 on every node"
    both = ra.stderr + rb.stderr
    assert "rank 3" in both and "exited with code 5" in both
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 4
    assert not any(pid_alive(p) for p in pids), "no rank may outlive its worker"


@pytest.mark.slow
def test_max_restarts_recovers_from_one_failure(coord: RunningCoordinator, procs: Procs) -> None:
    script = (
        "import os, sys, time\n"
        "gen, rank = int(os.environ['AXOND_GENERATION']), os.environ['RANK']\n"
        "print('GEN', gen, 'RANK', rank, flush=True)\n"
        "if gen == 1 and rank == '0':\n"
        "    sys.exit(3)\n"
        "time.sleep(30 if gen == 1 else 0)\n"
    )
    args = worker_args(coord, "restart", "--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1")
    a = procs.axond(*args, "--", PY, "-c", script)
    b = procs.axond(*args, "--", PY, "-c", script)
    ra, rb = procs.finish(a, timeout=60), procs.finish(b, timeout=60)
    assert ra.code == 0 and rb.code == 0, (ra.stderr, rb.stderr)
    out = ra.stdout + rb.stdout
    finals = {line.split("] ", 1)[1] for line in out.splitlines() if "GEN 2" in line}
    assert finals == {f"GEN 2 RANK {r}" for r in range(4)}
    assert "restarts as generation 2" in ra.stderr + rb.stderr
    assert "generation 2" in ra.stderr and "generation 2" in rb.stderr


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_restarts_run_out_and_the_job_fails(coord: RunningCoordinator, procs: Procs) -> None:
    script = "import os, sys; print('GEN', os.environ['AXOND_GENERATION'], flush=True); sys.exit(9)"
    res = procs.run(*worker_args(coord, "hopeless", "--max-restarts", "2"), "--", PY, "-c", script, timeout=60)
    assert res.code == 1, res.stderr
    assert "exited with code 9" in res.stderr.splitlines()[-1]
    gens = [line.split()[-1] for line in res.stdout.splitlines() if "GEN" in line]
    assert gens == ["1", "2", "3"]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_sigterm_stops_the_worker_and_its_ranks(coord: RunningCoordinator, procs: Procs, tmp_path: Path) -> None:
    script = (
        "import os, time, pathlib\n"
        f"pathlib.Path({str(tmp_path)!r}, os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    w = procs.axond(*worker_args(coord, "term", "--nproc-per-node", "2"), "--", PY, "-c", script)
    wait_for(lambda: len(list(tmp_path.iterdir())) == 2, 30, "both ranks to start")
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    os.kill(w.pid, signal.SIGTERM)
    res = procs.finish(w, timeout=20)
    assert res.code == 128 + signal.SIGTERM, res.stderr
    assert not any(pid_alive(p) for p in pids)


@pytest.mark.slow
def test_a_dead_worker_is_noticed_by_the_others(coord: RunningCoordinator, procs: Procs, tmp_path: Path) -> None:
    script = (
        "import os, time, pathlib\n"
        f"pathlib.Path({str(tmp_path)!r}, os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    args = worker_args(coord, "dead-node", "--nnodes", "2")
    a = procs.axond(*args, "--", PY, "-c", script)
    b = procs.axond(*args, "--", PY, "-c", script)
    wait_for(lambda: len(list(tmp_path.iterdir())) == 2, 30, "both ranks to start")
    pids = {int(p.name): int(p.read_text()) for p in tmp_path.iterdir()}
    try:
        os.kill(a.pid, signal.SIGKILL)
        t0 = time.monotonic()
        rb = procs.finish(b, timeout=30)
        assert rb.code != 0
        assert time.monotonic() - t0 < 15
        assert "missed" in rb.stderr and "heartbeats" in rb.stderr, rb.stderr
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_sigterm_while_waiting_for_the_rendezvous(coord: RunningCoordinator, procs: Procs) -> None:
    w = procs.axond(*worker_args(coord, "lonely", "--nnodes", "2"), "--", PY, "-c", "pass")
    wait_for(lambda: any(j.job == "lonely" for j in coord_status(coord).jobs), 20, "the worker to join")
    os.kill(w.pid, signal.SIGTERM)
    t0 = time.monotonic()
    res = procs.finish(w, timeout=20)
    assert res.code == 128 + signal.SIGTERM, res.stderr
    assert time.monotonic() - t0 < 5
    assert "Traceback" not in res.stderr
    assert not coord_status(coord).nodes, "the node left the coordinator"


def coord_status(c: RunningCoordinator) -> pb.GetStatusResponse:
    with connect(c.address, call_timeout=5.0) as client:
        return client.get_status()


@pytest.mark.slow
def test_a_node_that_finished_first_rejoins_when_the_job_restarts(coord: RunningCoordinator, procs: Procs) -> None:
    script = (
        "import os, sys, time\n"
        "gen, rank = int(os.environ['AXOND_GENERATION']), int(os.environ['RANK'])\n"
        "print('GEN', gen, 'RANK', rank, flush=True)\n"
        "if gen == 1 and rank == 0:\n"
        "    time.sleep(1.5); sys.exit(3)\n"
    )
    args = worker_args(coord, "early", "--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1")
    a = procs.axond(*args, "--", PY, "-c", script)
    b = procs.axond(*args, "--", PY, "-c", script)
    ra, rb = procs.finish(a, timeout=60), procs.finish(b, timeout=60)
    assert ra.code == 0 and rb.code == 0, (ra.stderr, rb.stderr)
    finals = {line.split("] ", 1)[1] for line in (ra.stdout + rb.stdout).splitlines() if "GEN 2" in line}
    assert finals == {f"GEN 2 RANK {r}" for r in range(4)}, "the early finisher ran generation 2 too"


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_elastic_nnodes_runs_with_the_nodes_that_came(coord: RunningCoordinator, procs: Procs) -> None:
    res = procs.run(*worker_args(coord, "elastic", "--nnodes", "1:2", "--nproc-per-node", "2"),
                    "--", PY, "-c", ENV_SCRIPT)
    assert res.code == 0, res.stderr
    envs = res.env_lines()
    assert sorted(envs) == [0, 1] and {e["WORLD_SIZE"] for e in envs.values()} == {"2"}
