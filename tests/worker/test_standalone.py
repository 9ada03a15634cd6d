"""`axond worker --standalone`: a one-machine job with an embedded coordinator, and nothing left behind."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from worker_support import ENV_SCRIPT, Procs, axond_argv, procs  # noqa: F401

PY = sys.executable


def isolated_env(tmp_path: Path) -> dict[str, str]:
    """HOME, XDG dirs and TMPDIR inside tmp_path, so that any file the command leaves behind is seen."""
    env = {}
    for name in ("HOME", "XDG_STATE_HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR", "TMPDIR"):
        path = tmp_path / name.lower()
        path.mkdir()
        env[name] = str(path)
    return env


def leftovers(tmp_path: Path, skip: str) -> list[str]:
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                  if p.is_file() and not p.relative_to(tmp_path).parts[0] == skip)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.timeout(120)
def test_standalone_trains_the_example_and_leaves_nothing_behind(procs: Procs, tmp_path: Path) -> None:
    env = isolated_env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    cmd = ["worker", "--standalone", "--nproc-per-node", "2", "--",
           PY, "-m", "axond.examples.train_mlp", "--epochs", "1", "--samples", "1024"]
    res = procs.finish(procs.start([*axond_argv(), *cmd], env=env, cwd=str(work)), timeout=100)
    assert res.code == 0, res.stderr
    assert "[rank 0] epoch 1/1" in res.stdout
    assert "world size 2" in res.stderr
    assert (work / "checkpoints" / "train_mlp.npz").exists(), "the job's own output is where it asked"
    assert leftovers(tmp_path, skip="work") == [], "no state, token or error files left behind"


def test_standalone_ranks_reach_their_coordinator(procs: Procs, tmp_path: Path) -> None:
    res = procs.run("worker", "--standalone", "--nproc-per-node", "2", "--", PY, "-c", ENV_SCRIPT,
                    env=isolated_env(tmp_path))
    assert res.code == 0, res.stderr
    envs = res.env_lines()
    assert sorted(envs) == [0, 1]
    address = envs[0]["AXOND_COORDINATOR"]
    assert address is not None and address.startswith("127.0.0.1:")
    assert envs[0]["AXOND_TOKEN"] and len(envs[0]["AXOND_TOKEN"] or "") >= 32, "a random token guards it"
    assert envs[0]["WORLD_SIZE"] == "2" and envs[1]["RANK"] == "1"
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex((host, int(port))) != 0, "the embedded coordinator stopped with the worker"


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_standalone_collectives_and_failure(procs: Procs, tmp_path: Path) -> None:
    script = (
        "import numpy as np, axond\n"
        "axond.init_process_group()\n"
        "x = np.full(3, axond.get_rank() + 1.0)\n"
        "axond.all_reduce(x)\n"
        "print('SUM', x.tolist())\n"
        "axond.destroy_process_group()\n"
    )
    res = procs.run("worker", "--standalone", "--nproc-per-node", "2", "--", PY, "-c", script,
                    env=isolated_env(tmp_path))
    assert res.code == 0, res.stderr
    assert res.stdout.count("SUM [3.0, 3.0, 3.0]") == 2
    bad = procs.run("worker", "--standalone", "--", PY, "-c", "raise SystemExit('no data')")
    assert bad.code == 1
    assert bad.stderr.strip().splitlines()[-1].endswith("no data"), bad.stderr


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("args, says", [
    (("--coordinator", "127.0.0.1:1"), "drop --coordinator"),
    (("--nnodes", "2"), "one-machine job"),
    ((), "pass its command"),
])
def test_standalone_usage_errors(procs: Procs, args: tuple[str, ...], says: str) -> None:
    cmd = ("--", PY, "-c", "pass") if args else ()
    res = procs.run("worker", "--standalone", *args, *cmd)
    assert res.code == 2 and says in res.stderr, res.stderr


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_standalone_ignores_a_coordinator_in_the_environment(procs: Procs, tmp_path: Path) -> None:
    res = procs.run("worker", "--standalone", "--", PY, "-c", ENV_SCRIPT,
                    env={**isolated_env(tmp_path), "AXOND_COORDINATOR": "192.0.2.1:29500"})
    assert res.code == 0, res.stderr
    assert (res.env_lines()[0]["AXOND_COORDINATOR"] or "").startswith("127.0.0.1:")
