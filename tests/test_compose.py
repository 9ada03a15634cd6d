"""compose.yaml without Docker: every service's command line runs as a local process on loopback.

Service names resolve to 127.0.0.1 and the coordinator port is rewritten to a free one; the
healthcheck gates the workers as `depends_on: condition: service_healthy` does; both workers must
exit 0 with the four ranks of the example job.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from test_worker_support import Procs, axond_argv, free_port, procs  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_PORT = "29500"
STATE_DIR = "/var/lib/axond"
"""Where the coordinator keeps its state (and its generated token) in the compose file: a named volume."""
UP_COMMAND = "docker compose up --build --exit-code-from worker-0"
"""The one documented command: it returns when the job ended, with worker-0's (= the job's) exit code."""

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


def localize(args: list[str], services: list[str], port: int, state_dir: str = STATE_DIR) -> list[str]:
    """Rewrite service names / localhost to 127.0.0.1, the compose port to `port` and the state volume's
    mount point to `state_dir`."""
    out = []
    for arg in args:
        arg = arg.replace(STATE_DIR, state_dir)
        for host in [*services, "localhost"]:
            arg = arg.replace(f"{host}:{COMPOSE_PORT}", f"127.0.0.1:{port}")
        if arg == COMPOSE_PORT:
            arg = str(port)
        if EXAMPLE_OVERRIDE is not None:
            arg = arg.replace(EXAMPLE_MODULE, EXAMPLE_OVERRIDE)
        out.append(arg)
    return out


def as_command(args: list[str]) -> list[str]:
    """Compose `command:` args after the `axond` entry point, as a local command line."""
    assert entrypoint() == ["axond"]
    return [*axond_argv(), *args]


def test_compose_file_shape() -> None:
    compose = load_compose()
    services = compose["services"]
    assert entrypoint() == ["axond"]
    coordinator = services["coordinator"]
    assert coordinator["command"][0] == "coordinator"
    assert coordinator["healthcheck"]["test"][:3] == ["CMD", "axond", "health"]
    workers = [name for name, svc in services.items() if svc["command"][0] == "worker"]
    assert len(workers) == 2
    for name in workers:
        svc = services[name]
        cmd = svc["command"]
        assert svc["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert cmd[cmd.index("--coordinator") + 1] == f"coordinator:{COMPOSE_PORT}"
        assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "2"
        assert cmd[cmd.index("--") + 1:] == ["python", "-m", EXAMPLE_MODULE]
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"


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
    workdir = re.findall(r"^WORKDIR\s+(\S+)", (ROOT / "docker" / "Dockerfile").read_text(), re.M)[-1]
    from axond.examples.train_mlp import TrainConfig

    checkpoint_dir = str(Path(workdir, TrainConfig().checkpoint).parent)
    for name in ("worker-0", "worker-1"):
        svc = services[name]
        assert _volume(svc, STATE_DIR) == (state, True), "workers read the coordinator's token, read-only"
        wcmd = svc["command"]
        assert wcmd[wcmd.index("--token-file") + 1] == f"{STATE_DIR}/token"
        source, read_only = _volume(svc, checkpoint_dir)
        assert source in volumes and not read_only, "rank 0's checkpoint lands on a named volume"


def _supports(command: str, flag: str) -> bool:
    res = subprocess.run([*axond_argv(), command, "--help"], capture_output=True, text=True, timeout=60)
    return flag in res.stdout


@pytest.mark.timeout(180)
def test_compose_services_run_as_local_processes(procs: Procs, tmp_path: Path) -> None:
    if not (_supports("coordinator", "--state-dir") and _supports("worker", "--token-file")):
        pytest.skip("needs `axond coordinator --state-dir` and `axond worker --token-file`")
    compose = load_compose()
    services: dict[str, Any] = compose["services"]
    names = list(services)
    port = free_port()
    started = {}
    order = sorted(names, key=lambda n: bool(services[n].get("depends_on")))
    for name in order:
        svc = services[name]
        for dep, cond in (svc.get("depends_on") or {}).items():
            if cond.get("condition") == "service_healthy":
                check = services[dep]["healthcheck"]
                test = check["test"]
                assert test[0] == "CMD"
                argv = localize(test[1:], names, port, str(tmp_path / "state"))
                assert argv[0] == "axond"
                deadline = time.monotonic() + 60
                while procs.run(*argv[1:], timeout=30).code != 0:
                    assert started[dep].poll() is None, f"service {dep} exited before it was healthy"
                    assert time.monotonic() < deadline, f"service {dep} never became healthy"
                    time.sleep(0.2)
        workdir = tmp_path / name
        workdir.mkdir()
        argv = localize(svc["command"], names, port, str(tmp_path / "state"))
        started[name] = procs.start(as_command(argv), cwd=str(workdir))
    blocks = set()
    for name in names:
        if services[name]["command"][0] == "worker":
            res = procs.finish(started[name], timeout=150)
            assert res.code == 0, f"service {name} exited {res.code}:\n{res.stderr}"
            blocks.update(re.findall(r"ranks (\d+\.\.\d+) of world size 4", res.stderr))
            if "ranks 0..1" in res.stderr:
                assert "[rank 0] " in res.stdout, "rank 0 of the example prints its progress"
    assert blocks == {"0..1", "2..3"}, "two nodes of two ranks each"
    assert started["coordinator"].poll() is None, "the coordinator keeps serving"
