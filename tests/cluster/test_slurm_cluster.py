"""`axond slurm` under a real Slurm: slurmctld and two slurmds on network-namespace hosts, one 2-node sbatch job.

The batch script runs `srun --ntasks-per-node=1 axond slurm --nproc-per-node 2 -- python -m
axond.examples.train_mlp`: the first node starts the coordinator and publishes the token in the (shared) home
directory, the second reads it, and the four ranks train the example across the two hosts; slurmctld reports
the job COMPLETED with exit code 0. Skipped, with the reason, without root, `ip netns`, munge or Slurm.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import slurm_cluster
from netns import base_env, netns  # noqa: F401 - netns is the fixture
from slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slow  # a real Slurm cluster in namespaces

BATCH = """#!/bin/sh
#SBATCH --job-name=axond-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output={out}
srun --ntasks-per-node=1 {axond} slurm --nproc-per-node 2 --linger 20 -- \\
    {python} -m axond.examples.train_mlp --epochs 2 --checkpoint {ckpt}
"""


def axond_command() -> str:
    """`axond` for a shell line: the console script beside this interpreter, else the interpreter running the CLI."""
    script = Path(sys.executable).with_name("axond")
    return str(script) if script.is_file() else f"{sys.executable} -c 'from axond.cli.main import main; main()'"


@pytest.fixture
def cluster(netns, tmp_path: Path) -> Iterator[SlurmCluster]:
    reason = slurm_cluster.unavailable()
    if reason:
        pytest.skip(reason)
    net = netns(2)
    root = tmp_path / "slurm"
    root.mkdir()
    env = base_env(tmp_path / "home")
    try:
        yield slurm_cluster.start(net, root, env)
    finally:
        net.close()  # every daemon and job step dies with its namespace


@pytest.mark.timeout(300)
def test_two_node_sbatch_job_trains(cluster: SlurmCluster, tmp_path: Path) -> None:
    axond = axond_command()
    out = tmp_path / "job.out"
    script = tmp_path / "train.sbatch"
    script.write_text(BATCH.format(out=out, axond=axond, python=sys.executable, ckpt=tmp_path / "final.npz"))
    job_id, state, code = cluster.submit_and_wait(script, tmp_path, timeout=240)
    text = _read(out)
    assert (state, code) == ("COMPLETED", 0), f"job {state}, exit code {code}; output:\n{text}\n{cluster.logs()}"
    nodes = cluster.nodes
    for node_id, node in enumerate(nodes):
        assert f"Slurm job {job_id}: node {node_id} of 2 ({node})" in text, text
    assert f"job 'axond-train-{job_id}'" in text
    assert "node rank 0 of 2, ranks 0..1 of world size 4" in text and "node rank 1 of 2, ranks 2..3" in text
    assert "[rank 0] saved checkpoint" in text, text
    assert (tmp_path / "final.npz").is_file()
    head = cluster.net.hosts[0].addr
    assert f"coordinator at {head}:" in text, "every node reaches the coordinator at the head's NodeAddr"
    assert not list((tmp_path / "home" / ".axond" / "slurm").glob("*.token")), "the head removed the token"


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no output file)"


FAILING = """#!/bin/sh
#SBATCH --nodes=2
#SBATCH --output={out}
srun --ntasks-per-node=1 {axond} slurm --nproc-per-node 2 --linger 20 -- \\
    {python} -c "import os, sys; sys.exit(7 if os.environ['RANK'] == '3' else 0)"
"""


@pytest.mark.timeout(300)
def test_a_failed_rank_fails_the_slurm_job(cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    script = tmp_path / "fail.sbatch"
    script.write_text(FAILING.format(out=out, axond=axond_command(), python=sys.executable))
    _, state, code = cluster.submit_and_wait(script, tmp_path, timeout=240)
    text = _read(out)
    assert (state, code) == ("FAILED", 1), f"job {state} with exit code {code} although rank 3 exited 7:\n{text}"
    assert re.search(r"rank 3 .*exit(ed with)? code 7|exit code 7", text), text
