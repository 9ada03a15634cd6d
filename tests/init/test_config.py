"""Configuration is read once: `axond.config.RuntimeEnv.from_env` parses the environment, and nothing else reads it.

- Every module of axond, coordinator and worker reaches the environment only through `RuntimeEnv`; the AST scan
  below fails on any `os.environ` / `os.getenv` / `os.putenv` outside the short allow-list.
- `from_env` parses each variable the library and daemons use, and a bad value names the variable and what it
  accepts.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from axond.config import ConfigError, RuntimeEnv
from axond.distributed.backends.base import BackendOptions
from axond.distributed.backends.addresses import advertised_host
from axond.store.init_methods import open_store, parse
from axond.errors import DistributedError
from axond.v1 import coordinator_pb2 as pb
from axond.worker.agent import JobRunner
from axond.worker.spec import ConnectOptions, JobSpec

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("axond", "coordinator", "worker")
ENV_NAMES = frozenset({"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"})

ALLOWED = {
    "axond/config.py": "the one place the library reads the environment (RuntimeEnv.from_env)",
    "axond/cli/": "the command-line entry points: they build the RuntimeEnv a command passes down, and click's "
                  "envvar= options read their own variables; `--tls-cert` is exported to the ranks",
    "axond/testing/": "test harnesses that start rank processes and set their environment (run_processes, "
                      "module_ranks), like a launcher",
    "axond/testing_netns.py": "a test harness (netns commands need the PATH of the sbin directories)",
    "axond/examples/": "user scripts: they read their own settings (AXOND_CHECKPOINT) as any training script may",
}
"""Path prefix -> why it may touch the environment directly."""


def _env_uses(tree: ast.AST) -> list[int]:
    """Lines where `tree` touches the process environment through the os module."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENV_NAMES and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in ENV_NAMES for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_the_config_module_and_the_cli_read_the_environment() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(tuple(ALLOWED)):
                continue
            text = path.read_text()
            if any(name in text for name in ENV_NAMES):  # parse only the files that could (fast)
                offenders += [f"{rel}:{line}" for line in _env_uses(ast.parse(text, rel))]
    assert not offenders, ("read the environment through axond.config.RuntimeEnv (built once by init_process_group "
                           f"or the CLI and passed down), not os.environ: {offenders}")


def test_the_scan_sees_every_form() -> None:
    tree = ast.parse("import os\nfrom os import getenv\nos.environ.get('X')\nos.getenv('Y')\nos.putenv('Z', '1')\n"
                     "dict(os.environ)\nos.path.join('a')\n")
    assert sorted(_env_uses(tree)) == [2, 3, 4, 5, 6]


def test_from_env_parses_every_variable() -> None:
    env = RuntimeEnv.from_env({
        "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "run",
        "TORCHELASTIC_RESTART_COUNT": "2", "AXOND_COORDINATOR": "h1:1,h2:2", "AXOND_JOB": "j", "AXOND_GENERATION": "5",
        "AXOND_JOB_SECRET": "00ff", "AXOND_FILE_STORE": "/tmp/s", "AXOND_TOKEN": "t", "AXOND_TOKEN_FILE": "/tf",
        "AXOND_TLS_CA": "/ca", "AXOND_TLS_CERT": "/c", "AXOND_TLS_KEY": "/k", "AXOND_STATE_DIR": "/state",
        "AXOND_SOCKET_IFNAME": "eth1", "AXOND_DEBUG": "yes", "AXOND_ERROR_FILE": "/e.json", "AXOND_METRICS_DIR": "/m",
        "AXOND_TIMELINE": "/tl", "AXOND_TORCH_OVERLAP": "off", "AXOND_TORCH_STORE": "0", "AXOND_WAIT_NOTICE_S": "2.5",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "AXOND_TCP_SMALL_BYTES": "4096", "AXOND_FR_DUMP_DIR": "/fr",
        "AXOND_SHARD_MEMORY_FD": "7",
    })
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 1, 4)
    assert (env.master_addr, env.master_port, env.agent_store) == ("10.0.0.1", 29500, True)
    assert (env.elastic_run_id, env.restart_count) == ("run", "2")
    assert (env.coordinator, env.job, env.generation, env.job_secret, env.file_store) == \
        ("h1:1,h2:2", "j", 5, b"\x00\xff", "/tmp/s")
    assert (env.token, env.token_file, env.tls_ca, env.tls_cert, env.tls_key) == ("t", "/tf", "/ca", "/c", "/k")
    assert env.state_dir == Path("/state") and env.socket_ifname == "eth1"
    assert env.failure.debug and env.failure.error_file == "/e.json" and env.failure.fr_dump_dir == "/fr"
    assert (env.observe.metrics_dir, env.observe.timeline_dir) == ("/m", "/tl")
    assert (env.torch_overlap, env.torch_store, env.wait_notice_s, env.nccl_async_error_handling) == \
        (False, False, 2.5, "3")
    assert env.shard_memory_fd == 7
    assert env.environ["AXOND_TCP_SMALL_BYTES"] == "4096", "backend options read their own variables from environ"
    with pytest.raises(TypeError):
        env.environ["X"] = "1"  # type: ignore[index]  # a snapshot, read-only


def test_from_env_defaults() -> None:
    env = RuntimeEnv.from_env({"XDG_STATE_HOME": "/xdg", "RANK": " ", "AXOND_DEBUG": "nonsense"})
    assert env.rank is None, "a blank variable is an unset one"
    assert (env.coordinator, env.job, env.generation, env.job_secret) == ("", "default", 1, b"")
    assert env.state_dir == Path("/xdg/axond")
    assert not env.failure.debug, "AXOND_DEBUG is read leniently: only an explicit true value turns it on"
    assert env.torch_overlap is None and env.torch_store and env.wait_notice_s == 60.0
    assert not env.observe.active and not env.agent_store and env.shard_memory_fd is None


@pytest.mark.parametrize(("var", "value", "accepts"), [
    ("RANK", "two", "use an integer from 0 to"),
    ("WORLD_SIZE", "-1", "use an integer from 1 to 1048576"),
    ("LOCAL_RANK", "gpu0", "use an integer from 0 to"),
    ("MASTER_PORT", "http", "use an integer >= 0"),
    ("MASTER_PORT", "70000", "use a port number"),
    ("AXOND_GENERATION", "1.5", "use an integer"),
    ("AXOND_JOB_SECRET", "xyz", "use hex digits"),
    ("AXOND_WAIT_NOTICE_S", "soon", "use seconds"),
    ("AXOND_SHARD_MEMORY_FD", "-3", "use an integer from 0"),
    ("AXOND_TORCH_OVERLAP", "sometimes", "use auto, 1"),
])
def test_a_bad_value_names_the_variable_and_what_it_accepts(var: str, value: str, accepts: str) -> None:
    with pytest.raises(ConfigError, match=f"bad {var}.*{accepts}") as raised:
        RuntimeEnv.from_env({var: value})
    if var == "AXOND_JOB_SECRET":
        assert value not in str(raised.value), "a secret is not echoed"
    lenient = RuntimeEnv.from_env({var: value}, strict=False)  # as `import axond` reads it
    assert lenient == RuntimeEnv.from_env({}, strict=False)


def test_init_process_group_reports_a_bad_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    import axond

    monkeypatch.setenv("RANK", "x")
    with pytest.raises(DistributedError, match="init_process_group: bad RANK='x': use an integer"):
        axond.init_process_group("tcp")


def test_init_process_group_passes_its_env_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The env given (not os.environ, which names no store here) forms the group, and reaches its backend."""
    import axond

    for var in ("RANK", "WORLD_SIZE", "AXOND_COORDINATOR", "AXOND_FILE_STORE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    env = RuntimeEnv.from_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "3", "AXOND_FILE_STORE": str(tmp_path),
                               "AXOND_TCP_SMALL_BYTES": "4096"})
    group = axond.init_process_group("tcp", env=env)
    try:
        assert group.options.env is env
        assert group.backend.own_options().small_bytes == 4096  # type: ignore[union-attr]
        assert axond.get_local_rank() == 3
    finally:
        axond.destroy_process_group()


def test_the_parts_passed_down_read_only_their_env() -> None:
    assert advertised_host(None, RuntimeEnv.from_env({"AXOND_COORDINATOR": "127.0.0.1:1"})) == "127.0.0.1"
    assert advertised_host("10.9.9.9", RuntimeEnv.from_env({"AXOND_SOCKET_IFNAME": "nope0"})) == "10.9.9.9"
    with pytest.raises(DistributedError, match="AXOND_SOCKET_IFNAME='nope0'"):
        advertised_host(None, RuntimeEnv.from_env({"AXOND_SOCKET_IFNAME": "nope0"}))
    with pytest.raises(DistributedError, match="no store; set AXOND_COORDINATOR.*or MASTER_PORT"):
        open_store(parse("env://"), 0, 1, 1.0, b"", RuntimeEnv.from_env({"MASTER_ADDR": "127.0.0.1"}))
    given = RuntimeEnv.from_env({"AXOND_TIMELINE": "/tl"})
    assert BackendOptions(env=given).for_new_group().env is given
    assert BackendOptions(env=given).env.observe.timeline_dir == "/tl"


def test_the_worker_builds_its_ranks_environment_from_its_runtime_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's environment is the worker's RuntimeEnv (as the CLI read it) plus the job's: never os.environ now."""
    monkeypatch.setenv("SET_AFTER_THE_WORKER_STARTED", "1")
    env = RuntimeEnv.from_env({"PATH": "/bin", "FROM_THE_WORKER": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    conn = ConnectOptions("127.0.0.1:1", token="tok", env=env)
    runner = JobRunner(None, conn, "node-a", None, JobSpec(argv=("true",), job="j", env={"FROM_THE_JOB": "2"}))  # type: ignore[arg-type]
    joined = pb.JoinResponse(generation=3, rank_offset=2, local_world_size=2, world_size=4, node_rank=1, nnodes=2,
                             job_secret=b"\x01")
    try:
        specs = runner._rank_specs(joined)
    finally:
        shutil.rmtree(runner._error_dir or "", ignore_errors=True)
    assert [s.env["RANK"] for s in specs] == ["2", "3"]
    for spec in specs:
        assert spec.env["FROM_THE_WORKER"] == "1" and spec.env["FROM_THE_JOB"] == "2" and spec.env["PATH"] == "/bin"
        assert "SET_AFTER_THE_WORKER_STARTED" not in spec.env
        assert spec.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and spec.env["AXOND_TOKEN"] == "tok"
        assert (spec.env["AXOND_JOB"], spec.env["AXOND_GENERATION"], spec.env["AXOND_JOB_SECRET"]) == ("j", "3", "01")


def test_survivors_wait_before_exiting_only_under_torchrun() -> None:
    torchrun = {"TORCHELASTIC_RUN_ID": "run"}
    assert RuntimeEnv.from_env(torchrun).failure.survivor_exit_delay_s == 2.0
    assert RuntimeEnv.from_env({**torchrun, "AXOND_SURVIVOR_EXIT_DELAY_S": "0.5"}).failure.survivor_exit_delay_s == 0.5
    assert RuntimeEnv.from_env({**torchrun, "AXOND_SURVIVOR_EXIT_DELAY_S": "0"}).failure.survivor_exit_delay_s == 0.0
    assert RuntimeEnv.from_env({**torchrun, "AXOND_SURVIVOR_EXIT_DELAY_S": "x"}).failure.survivor_exit_delay_s == 2.0
    under_worker = {**torchrun, "AXOND_ERROR_FILE": "/e.json"}  # axond worker names the root cause itself
    assert RuntimeEnv.from_env(under_worker).failure.survivor_exit_delay_s == 0.0
    assert RuntimeEnv.from_env({}).failure.survivor_exit_delay_s == 0.0
