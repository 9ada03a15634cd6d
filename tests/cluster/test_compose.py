"""compose.yaml without Docker: every service's command line runs as a local process on loopback.

Service names resolve to 127.0.0.1 and the coordinator port is rewritten to a free one; the
healthcheck gates the workers as `depends_on: condition: service_healthy` does; both workers must
exit 0 with the four ranks of the example job.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from worker_support import Procs, axond_argv, free_port, procs  # noqa: F401

pytestmark = pytest.mark.slow  # every compose service as a real process

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_PORT = "29500"
STATE_DIR = "/var/lib/axond"
"""Where the coordinator keeps its state (coordinator.db) in the compose file: a volume only it mounts."""
TOKEN_DIR = "/run/axond"
"""Where every service finds the token (`token` file): a volume of its own, written once by the `token` service."""
UP_COMMAND = "docker compose up -d --build && docker compose wait worker-0"
"""The one documented command: it returns when the job ended, with worker-0's (= the job's) exit code, and
leaves a coordinator restart to axond (no --abort-on-container-exit)."""

EXAMPLE_MODULE = "axond.examples.train_mlp"
EXAMPLE_OVERRIDE: str | None = None if importlib.util.find_spec(EXAMPLE_MODULE) else "axond.examples.hello"
"""Module run instead of the compose file's example while that one does not exist yet (None: as written)."""


def load_compose() -> dict[str, Any]:
    with open(ROOT / "compose.yaml") as f:
        return yaml.safe_load(f)


def entrypoint() -> list[str]:
    """The Dockerfile's ENTRYPOINT, which compose's `command:` is appended to."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    match = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.M)
    assert match, "docker/Dockerfile needs an exec-form ENTRYPOINT"
    return yaml.safe_load(match.group(1))


def localize(args: list[str], services: list[str], port: int, state_dir: str = STATE_DIR,
             token_dir: str = TOKEN_DIR) -> list[str]:
    """Rewrite service names / localhost to 127.0.0.1, the compose port to `port` and the volumes' mount points
    to `state_dir` and `token_dir`."""
    out = []
    for arg in args:
        arg = arg.replace(STATE_DIR, state_dir).replace(TOKEN_DIR, token_dir)
        if arg == "python":
            arg = sys.executable
        for host in [*services, "localhost"]:
            arg = arg.replace(f"{host}:{COMPOSE_PORT}", f"127.0.0.1:{port}")
        arg = re.sub(rf"\b{COMPOSE_PORT}\b", str(port), arg)  # a bare port, and the one in the health check
        if EXAMPLE_OVERRIDE is not None:
            arg = arg.replace(EXAMPLE_MODULE, EXAMPLE_OVERRIDE)
        out.append(arg)
    return out


def as_command(svc: dict[str, Any], args: list[str]) -> list[str]:
    """A service's entry point and (localized) `command:` args as a local command line."""
    if "entrypoint" in svc:
        return args
    assert entrypoint() == ["axond"]
    return [*axond_argv(), *args]


def workers(services: dict[str, Any]) -> list[str]:
    return [name for name, svc in services.items() if svc.get("command", [""])[0] == "worker"]


def test_compose_file_shape() -> None:
    compose = load_compose()
    services = compose["services"]
    assert entrypoint() == ["axond"]
    coordinator = services["coordinator"]
    assert coordinator["command"][0] == "coordinator"
    assert coordinator["restart"] == "unless-stopped", "a crashed coordinator comes back by itself"
    check = coordinator["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-S"], "the health check starts a bare interpreter, not the whole CLI"
    names = workers(services)
    assert len(names) == 2
    for name in names:
        svc = services[name]
        cmd = svc["command"]
        assert svc["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert cmd[cmd.index("--coordinator") + 1] == f"coordinator:{COMPOSE_PORT}"
        assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "2"
        assert cmd[cmd.index("--") + 1:] == ["python", "-m", EXAMPLE_MODULE]
    built = [name for name, svc in services.items() if "build" in svc]
    assert built == ["token"], "one service builds the image, once per `up`"
    assert services["token"]["build"]["dockerfile"] == "docker/Dockerfile"
    assert {svc["image"] for svc in services.values()} == {"axond:latest"}
    assert coordinator["depends_on"]["token"]["condition"] == "service_completed_successfully"


def test_dockerfile_builds_helpers_and_runs_unprivileged() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.M)
    assert len(stages) == 2 and stages[0][1] == "build", "a builder stage, then the runtime stage"
    builder, runtime = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert "gcc" in builder and "gcc" not in runtime, "the compiler stays in the builder stage"
    assert "_hostcopy" in builder and "_fastbox" in builder, "the build fails if the C helpers did not compile"
    users = re.findall(r"^USER\s+(\S+)", runtime, re.M)
    assert users and users[-1] not in ("root", "0"), "the image runs as an unprivileged user"


def _volume(svc: dict[str, Any], target: str) -> tuple[str, bool]:
    """(source, read_only) of the short-form volume of `svc` mounted at `target`."""
    for spec in svc.get("volumes") or []:
        parts = spec.split(":")
        if parts[1] == target:
            return parts[0], parts[2:] == ["ro"]
    raise AssertionError(f"no volume mounted at {target}: {svc.get('volumes')}")


def _default(text: str) -> str:
    """Compose's `${VAR:-default}` interpolation with VAR unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def test_compose_returns_keeps_state_and_checkpoints_and_stays_local() -> None:
    text = (ROOT / "compose.yaml").read_text()
    assert UP_COMMAND in text.split("\nservices:")[0], "the top comment gives the one command to run"
    compose = load_compose()
    services, volumes = compose["services"], compose["volumes"]
    assert UP_COMMAND.split()[-1] in services
    coordinator = services["coordinator"]
    assert [_default(p) for p in coordinator["ports"]] == [f"127.0.0.1:{COMPOSE_PORT}:{COMPOSE_PORT}"], (
        "the port is published on loopback unless AXOND_PORT_BIND says otherwise"
    )
    cmd = coordinator["command"]
    assert cmd[cmd.index("--state-dir") + 1] == STATE_DIR
    state, read_only = _volume(coordinator, STATE_DIR)
    assert state in volumes and not read_only
    token, read_only = _volume(coordinator, TOKEN_DIR)
    assert token in volumes and token != state and read_only
    assert coordinator["environment"]["AXOND_TOKEN_FILE"] == f"{TOKEN_DIR}/token"
    assert coordinator["environment"]["AXOND_COORDINATOR"] == f"localhost:{COMPOSE_PORT}", "for `exec ... status`"
    assert _volume(services["token"], TOKEN_DIR) == (token, False), "only the token service writes the token"
    workdir = re.findall(r"^WORKDIR\s+(\S+)", (ROOT / "docker" / "Dockerfile").read_text(), re.M)[-1]
    from axond.examples.train_mlp import TrainConfig

    checkpoint_dir = str(Path(workdir, TrainConfig().checkpoint).parent)
    for name in workers(services):
        svc = services[name]
        sources = [spec.split(":")[0] for spec in svc["volumes"]]
        assert state not in sources, "no worker (and so no rank) can read coordinator.db and its node secrets"
        assert _volume(svc, TOKEN_DIR) == (token, True), "workers read the token, read-only"
        wcmd = svc["command"]
        assert wcmd[wcmd.index("--token-file") + 1] == f"{TOKEN_DIR}/token"
        source, read_only = _volume(svc, checkpoint_dir)
        assert source in volumes and not read_only, "rank 0's checkpoint lands on a named volume"


def _supports(command: str, flag: str) -> bool:
    res = subprocess.run([*axond_argv(), command, "--help"], capture_output=True, text=True, timeout=60)
    return flag in res.stdout


def _wait_healthy(procs: Procs, check: list[str], started: subprocess.Popen[str], name: str) -> None:
    deadline = time.monotonic() + 60
    while subprocess.run(check, capture_output=True, timeout=30).returncode != 0:
        assert started.poll() is None, f"service {name} exited before it was healthy"
        assert time.monotonic() < deadline, f"service {name} never became healthy"
        time.sleep(0.2)


@pytest.mark.timeout(180)
def test_compose_services_run_as_local_processes(procs: Procs, tmp_path: Path) -> None:
    if not (_supports("coordinator", "--state-dir") and _supports("worker", "--token-file")):
        pytest.skip("needs `axond coordinator --state-dir` and `axond worker --token-file`")
    compose = load_compose()
    services: dict[str, Any] = compose["services"]
    names = list(services)
    port = free_port()
    state, token = str(tmp_path / "volume-state"), str(tmp_path / "volume-token")
    Path(token).mkdir(mode=0o700)
    started: dict[str, subprocess.Popen[str]] = {}
    order: list[str] = []
    while len(order) < len(names):  # dependencies first, as compose starts them
        order += [n for n in names if n not in order and set(services[n].get("depends_on") or {}) <= set(order)]
    for name in order:
        svc = services[name]
        for dep, cond in (svc.get("depends_on") or {}).items():
            if cond.get("condition") == "service_completed_successfully":
                res = procs.finish(started[dep], timeout=30)
                assert res.code == 0, f"service {dep} exited {res.code}:\n{res.stderr}"
            elif cond.get("condition") == "service_healthy":
                test = services[dep]["healthcheck"]["test"]
                assert test[0] == "CMD"
                _wait_healthy(procs, localize(test[1:], names, port, state, token), started[dep], dep)
        workdir = tmp_path / name
        workdir.mkdir()
        argv = localize([*svc.get("entrypoint", []), *svc["command"]], names, port, state, token)
        env = {k: localize([v], names, port, state, token)[0] for k, v in (svc.get("environment") or {}).items()}
        started[name] = procs.start(as_command(svc, argv), env=env, cwd=str(workdir))
    assert (Path(token) / "token").stat().st_mode & 0o077 == 0, "the token file is private to its user"
    blocks = set()
    for name in workers(services):
        res = procs.finish(started[name], timeout=150)
        assert res.code == 0, f"service {name} exited {res.code}:\n{res.stderr}"
        blocks.update(re.findall(r"ranks (\d+\.\.\d+) of world size 4", res.stderr))
        if "ranks 0..1" in res.stderr:
            assert "[rank 0] " in res.stdout, "rank 0 of the example prints its progress"
    assert blocks == {"0..1", "2..3"}, "two nodes of two ranks each"
    assert started["coordinator"].poll() is None, "the coordinator keeps serving"
    status = procs.start([*axond_argv(), "status"], env=env | {"AXOND_COORDINATOR": f"127.0.0.1:{port}"})
    res = procs.finish(status, timeout=60)
    assert res.code == 0 and "succeeded" in res.stdout, f"`axond status` with the services' environment:\n{res}"
