"""compose.yaml under a real container engine: the documented command trains the example job to exit 0.

Runs where `docker info` answers and Compose v2 is installed (set DOCKER_CONFIG to where its CLI plugin lives)
and the base image `python:3.11-slim` is present; skipped with the reason elsewhere (the test never starts an
engine itself). Each run builds the image, runs `up -d --build` + `wait worker-0` in a project of its own on a
free port, checks who runs what and who mounts what, and removes everything with `down -v`.
AXOND_COMPOSE_RUNS=N repeats the plain run N times (default 1).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_compose import STATE_DIR, load_compose, workers
from worker_support import free_port

pytestmark = pytest.mark.slow  # compose under a real container engine

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "python:3.11-slim"
RUNS = int(os.environ.get("AXOND_COMPOSE_RUNS", "1"))


def _engine_unavailable() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return "no `docker` CLI on PATH (a container engine with Compose v2 is needed)"
    checks = [
        ([docker, "info"], "the container engine is not running (`docker info` failed)"),
        ([docker, "compose", "version"], "Compose v2 is missing (`docker compose version` failed; set DOCKER_CONFIG "
                                         "to the directory holding cli-plugins/docker-compose)"),
        ([docker, "image", "inspect", BASE_IMAGE], f"the base image {BASE_IMAGE} is not present (docker pull it, or "
                                                   "build a stand-in with make-base-image.sh where Docker Hub is "
                                                   "out of reach)"),
    ]
    for argv, reason in checks:
        try:
            if subprocess.run(argv, capture_output=True, timeout=30).returncode != 0:
                return reason
        except (OSError, subprocess.TimeoutExpired):
            return reason
    return None


class Project:
    """`docker compose -p NAME` on this repository's compose file (plus overrides), on a free host port."""

    def __init__(self, name: str, overrides: list[Path] | None = None) -> None:
        self.name = name
        files = [ROOT / "compose.yaml", *(overrides or [])]
        self.base = ["docker", "compose", "-p", name, "--project-directory", str(ROOT)]
        for f in files:
            self.base += ["-f", str(f)]
        self.env = dict(os.environ, AXOND_PORT=str(free_port()))

    def __call__(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and done.returncode != 0:
            pytest.fail(f"`docker compose {' '.join(args)}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}\n"
                        f"logs:\n{self.logs()}")
        return done

    def logs(self) -> str:
        done = subprocess.run([*self.base, "logs", "--no-color"], capture_output=True, text=True, timeout=60,
                              env=self.env)
        return done.stdout[-6000:]

    def container(self, service: str) -> dict:  # type: ignore[type-arg]
        cid = self("ps", "-a", "-q", service).stdout.split()[0]
        out = subprocess.run(["docker", "inspect", cid], capture_output=True, text=True, timeout=30, check=True)
        return json.loads(out.stdout)[0]  # type: ignore[no-any-return]

    def up_and_wait(self) -> int:
        self("up", "-d", "--build", timeout=900)
        done = self("wait", "worker-0", timeout=600, check=False)
        return done.returncode


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Project]:
    reason = _engine_unavailable()
    if reason:
        pytest.skip(reason)
    made: list[Project] = []

    def make(overrides: list[Path] | None = None) -> Project:
        p = Project(f"axondtest{os.getpid()}x{len(made)}", overrides)
        made.append(p)
        return p

    yield make  # type: ignore[misc]
    for p in made:
        p("down", "-v", "--remove-orphans", "--timeout", "5", timeout=180, check=False)


def _check_isolation(p: Project) -> None:
    """Every service runs as the image's unprivileged user; only the coordinator mounts its state."""
    services = load_compose()["services"]
    state_volume = f"{p.name}_axond-state"
    for name in services:
        info = p.container(name)
        assert info["Config"]["User"] == "axond", f"{name} runs as {info['Config']['User']!r}"
        mounted = {m.get("Name") for m in info["Mounts"]}
        if name in workers(services):
            assert state_volume not in mounted, f"{name} mounts the coordinator's state"
        if name == "coordinator":
            assert any(m["Destination"] == STATE_DIR for m in info["Mounts"])


@pytest.mark.timeout(900 * RUNS + 300)
def test_compose_up_wait_trains(project) -> None:  # type: ignore[no-untyped-def]
    for run in range(RUNS):
        p = project()
        code = p.up_and_wait()
        assert code == 0, f"run {run + 1} of {RUNS}: worker-0 exited {code}; logs:\n{p.logs()}"
        _check_isolation(p)
        status = p("exec", "-T", "coordinator", "axond", "status")
        assert "train-mlp  succeeded" in status.stdout, status.stdout
        assert p("exec", "-T", "coordinator", "id", "-u").stdout.strip() != "0"
        p("down", "-v", "--remove-orphans", "--timeout", "5", timeout=180)


LONG_JOB = """services:
  worker-0:
    command: [worker, --coordinator, "coordinator:29500", --token-file, /run/axond/token, --job, train-mlp,
              --nnodes, "2", --nproc-per-node, "2", --, python, -m, axond.examples.train_mlp, --epochs, "60"]
  worker-1:
    command: [worker, --coordinator, "coordinator:29500", --token-file, /run/axond/token, --job, train-mlp,
              --nnodes, "2", --nproc-per-node, "2", --, python, -m, axond.examples.train_mlp, --epochs, "60"]
"""


def _crash(p: Project, service: str) -> None:
    """SIGKILL the service's main process from the host, as a crash would end it (`docker kill` would count as a
    deliberate stop, which the restart policy leaves stopped)."""
    pid = int(p.container(service)["State"]["Pid"])
    if pid <= 0 or not Path(f"/proc/{pid}").exists():
        pytest.skip("the engine's processes are not visible from here (remote or virtualised engine)")
    os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("how", ["restart", "crash"])
def test_compose_job_survives_coordinator_restart(  # type: ignore[no-untyped-def]
    project, tmp_path: Path, how: str
) -> None:
    override = tmp_path / "long-job.yaml"
    override.write_text(LONG_JOB)
    p = project([override])
    p("up", "-d", "--build", timeout=900)
    deadline = time.monotonic() + 300
    while "[rank 0] epoch 2/" not in p("logs", "--no-color", "worker-0").stdout:
        assert time.monotonic() < deadline, f"the job did not reach epoch 2; logs:\n{p.logs()}"
        assert not p("ps", "-q", "--status", "exited", "worker-0").stdout.strip(), p.logs()
        time.sleep(0.5)
    for name in ("worker-0", "worker-1"):
        top = p("top", name).stdout
        rows = [line.split() for line in top.splitlines() if line.strip() and not line.startswith(("UID", p.name))]
        assert rows and all(r[0] != "root" for r in rows), f"{name} runs processes as root:\n{top}"
        found = p("exec", "-T", name, "find", "/", "-path", "/proc", "-prune", "-o", "-name", "coordinator.db",
                  "-print", check=False).stdout
        assert "coordinator.db" not in found, f"{name} can see {found}"
    if how == "restart":
        p("restart", "--timeout", "5", "coordinator", timeout=120)
    else:
        _crash(p, "coordinator")
    assert p("ps", "-q", "--status", "running", "worker-0").stdout.strip(), "the job ended before the restart"
    code = p("wait", "worker-0", timeout=600, check=False).returncode
    assert code == 0, f"the job did not survive the coordinator's restart (worker-0 exited {code}):\n{p.logs()}"
    status = p("exec", "-T", "coordinator", "axond", "status").stdout
    assert "train-mlp  succeeded  1 " in status, f"the job finished in its first generation:\n{status}"
    if how == "crash":
        assert p.container("coordinator")["RestartCount"] == 1, "the restart policy brought the coordinator back"
