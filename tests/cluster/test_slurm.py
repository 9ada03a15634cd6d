"""`axond slurm` without Slurm: hostlist expansion, the allocation read from srun's variables, the token file,
and a one-node job run for real under a Slurm-like environment (tests/cluster/test_slurm_cluster.py runs slurmd)."""

from __future__ import annotations

import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from axond.worker.slurm import Allocation, SlurmError, default_token_path, expand_hostlist, publish_token
from axond.worker.slurm import wait_for_token
from axond.coordinator.server import RunningCoordinator
from worker_support import axond_argv, coord, free_port  # noqa: F401 - coord is a fixture


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[9-10]", ["n9", "n10"]),
    ("gpu-a[1-2]-ib,login1", ["gpu-a1-ib", "gpu-a2-ib", "login1"]),
    ("a[1-2],b[3,5],c", ["a1", "a2", "b3", "b5", "c"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("node[007-008]", ["node007", "node008"]),
    (" host-1.example.org , host-2 ", ["host-1.example.org", "host-2"]),
    ("nid[00001-00003]", ["nid00001", "nid00002", "nid00003"]),
])
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, says", [
    ("", "empty"),
    ("node[1-3", "never closed"),
    ("node1-3]", "without '['"),
    ("node[[1-2]]", "nested"),
    ("node[3-1]", "backwards"),
    ("node[a-b]", "not N or N-M"),
    ("node[]", "not N or N-M"),
    ("a,,b", "empty item"),
    ("node[1-99999999]", "more than"),
])
def test_expand_hostlist_refuses_malformed_text(text: str, says: str) -> None:
    with pytest.raises(SlurmError, match=says.replace("[", r"\[")):
        expand_hostlist(text)


def slurm_env(**extra: str) -> dict[str, str]:
    """What srun sets for task 0 of a 2-node step with one task per node (plus `extra`)."""
    env = {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train job", "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NNODES": "2",
        "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_LOCALID": "0", "SLURM_CPUS_ON_NODE": "8",
    }
    env.update(extra)
    return env


def test_allocation_from_srun_variables() -> None:
    alloc = Allocation.from_env(slurm_env(SLURM_NODEID="1", SLURM_GPUS_ON_NODE="4"))
    assert alloc.nodes == ("node01", "node02") and alloc.nnodes == 2
    assert alloc.node_id == 1 and not alloc.is_head and alloc.head == "node01"
    assert alloc.default_job() == "train-job-4242"
    assert alloc.default_port() == 29500 + 4242 % 1000
    assert alloc.nproc("auto") == 4 and alloc.nproc("gpu") == 4 and alloc.nproc("cpu") == 8 and alloc.nproc("3") == 3
    assert alloc.rank_order_notice() is None


def test_allocation_prefers_the_step_nodelist_and_counts_cpus_per_task() -> None:
    env = slurm_env(SLURM_JOB_NODELIST="node[01-04]", SLURM_NNODES="4", SLURM_STEP_NODELIST="node[03-04]",
                    SLURM_CPUS_PER_TASK="2")
    alloc = Allocation.from_env(env)
    assert alloc.nodes == ("node03", "node04") and alloc.head == "node03"
    assert alloc.nproc("cpu") == 2 and alloc.nproc("auto") == 1, "no GPUs: one rank per node unless told"


def test_allocation_says_what_is_wrong() -> None:
    cases = [
        ({"SLURM_JOB_ID": ""}, "inside a Slurm job"),
        ({"SLURM_NODEID": ""}, "start `axond slurm` with srun"),
        ({"SLURM_STEP_ID": ""}, "not directly in the batch script"),
        ({"SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""}, "SLURM_STEP_NODELIST"),
        ({"SLURM_NODEID": "2"}, "outside the 2 nodes"),
        ({"SLURM_STEP_NODELIST": "", "SLURM_STEP_NUM_NODES": "", "SLURM_NNODES": "3"}, "names 2 nodes"),
        ({"SLURM_STEP_NODELIST": "node[01-02],node01"}, "names a node twice"),
        ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, "--ntasks-per-node=1"),
        ({"SLURM_LOCALID": "1"}, "more than one task per node"),
    ]
    for extra, says in cases:
        with pytest.raises(SlurmError, match=says.replace("[", r"\[")):
            Allocation.from_env(slurm_env(**extra))
    alloc = Allocation.from_env(slurm_env())
    for choice, says in (("gpu", "SLURM_GPUS_ON_NODE"), ("0", ">= 1"), ("many", "number, auto, gpu or cpu")):
        with pytest.raises(SlurmError, match=says):
            alloc.nproc(choice)


def test_unpadded_names_keep_slurms_order_and_others_get_a_notice() -> None:
    alloc = Allocation.from_env(slurm_env(SLURM_STEP_NODELIST="n[9-10]"))
    assert alloc.nodes == ("n9", "n10")
    assert alloc.rank_order_notice() is None, "the coordinator compares the digit runs as numbers, as Slurm does"
    alloc = Allocation.from_env(slurm_env(SLURM_STEP_NODELIST="b1,a1", SLURM_NNODES="2"))
    assert "SLURM_NODEID" in (alloc.rank_order_notice() or "")


def test_token_file_is_private_replaced_whole_and_waited_for(tmp_path: Path) -> None:
    alloc = Allocation.from_env(slurm_env(SLURM_RESTART_COUNT="1"))
    path = default_token_path(alloc, home=str(tmp_path))
    assert path == tmp_path / ".axond" / "slurm" / "4242.0.r1.token"
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(wait_for_token(path, timeout=30, poll=0.01)))
    reader.start()
    token = publish_token(path)
    reader.join(30)
    assert got == [token] and len(token) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert publish_token(path) != token, "a new step never reuses a stale token"
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file is left behind"
    with pytest.raises(SlurmError, match="storage every node shares"):
        wait_for_token(tmp_path / "missing.token", timeout=0.05, poll=0.01)


def _slurm(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "AXOND_"))}
    full.update(env)
    return subprocess.run([*axond_argv(), "slurm", *args], capture_output=True, text=True, env=full, timeout=timeout)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_cli_refuses_to_run_outside_srun() -> None:
    res = _slurm(["--", "true"], {})
    assert res.returncode == 2 and "SLURM_JOB_ID is not set" in res.stderr
    res = _slurm(["--", "true"], slurm_env(SLURM_LOCALID="1"))
    assert res.returncode == 2 and "--ntasks-per-node=1" in res.stderr


def test_cli_dry_run_prints_the_plan(tmp_path: Path) -> None:
    env = slurm_env(**ONE_NODE, HOME=str(tmp_path))
    res = _slurm(["--dry-run", "--nproc-per-node", "2", "--", "python", "train.py"], env)
    assert res.returncode == 0, res.stderr
    assert (f"job=train-job-4242 nnodes=1 node_id=0 head=localhost coordinator=127.0.0.1:{29500 + 242} "
            f"nproc_per_node=2 token={tmp_path}/.axond/slurm/4242.0.token") in res.stdout
    assert not (tmp_path / ".axond").exists(), "a dry run starts and writes nothing"


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.timeout(180)
def test_one_node_job_runs_under_srun_variables(tmp_path: Path) -> None:
    """A real job: the head starts its coordinator, publishes the token, runs 2 ranks and cleans up."""
    env = slurm_env(**ONE_NODE, HOME=str(tmp_path))
    res = _slurm(["--nproc-per-node", "2", "--port", str(free_port()), "--linger", "5", "--", "python", "-m",
                  "axond.examples.hello"], env, timeout=150)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert "node 0 of 1 (localhost)" in res.stderr and "ranks 0..1 of world size 2" in res.stderr
    assert not list((tmp_path / ".axond" / "slurm").iterdir()), "the head removes the token it published"


ONE_NODE = dict(SLURM_STEP_NODELIST="localhost", SLURM_NNODES="1", SLURM_STEP_NUM_NODES="1", SLURM_NTASKS="1",
                SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1")


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.timeout(180)
def test_joins_a_running_coordinator(coord: RunningCoordinator, tmp_path: Path) -> None:
    """--coordinator: no coordinator is started, no token file written; the job runs on the one given."""
    env = slurm_env(**ONE_NODE, HOME=str(tmp_path))
    res = _slurm(["--coordinator", coord.address, "--", "true"], env)
    assert res.returncode == 2 and "pass that coordinator's token" in res.stderr
    token_file = tmp_path / "token"
    token_file.write_text(str(coord.token))
    res = _slurm(["--coordinator", coord.address, "--token-file", str(token_file), "--job", "given", "--", "python",
                  "-m", "axond.examples.hello"], env, timeout=150)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert f"coordinator at {coord.address} (given)" in res.stderr
    assert not (tmp_path / ".axond").exists()


def test_head_address_never_hands_out_loopback_for_several_nodes() -> None:
    from axond.worker.slurm import head_address

    one = Allocation.from_env(slurm_env(**ONE_NODE))
    assert head_address(one) == "127.0.0.1", "a one-node job may stay on loopback"
    env = slurm_env(SLURM_STEP_NODELIST="localhost,127.0.0.2", SLURM_JOB_NODELIST="localhost,127.0.0.2")
    with pytest.raises(SlurmError, match="no route to '127.0.0.2' shows another address"):
        head_address(Allocation.from_env(env))
    with pytest.raises(SlurmError, match="fix the name resolution"):
        head_address(Allocation.from_env(dict(env, SLURM_NODEID="1")))
    with pytest.raises(SlurmError, match="cannot resolve the head node"):
        head_address(Allocation.from_env(slurm_env(SLURM_STEP_NODELIST="no-such-host.invalid,b")))


def test_tasks_per_node_lists() -> None:
    for text in ("1(x16)", "1", "1,1(x3)"):
        Allocation.from_env(slurm_env(SLURM_STEP_TASKS_PER_NODE=text))
    for text in ("2(x3),1", "1,2"):
        with pytest.raises(SlurmError, match="more than one task per node"):
            Allocation.from_env(slurm_env(SLURM_STEP_TASKS_PER_NODE=text))
    with pytest.raises(SlurmError, match="is not a list like"):
        Allocation.from_env(slurm_env(SLURM_STEP_TASKS_PER_NODE="two"))
