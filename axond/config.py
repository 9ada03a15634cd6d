"""The process's configuration from its environment, read once: `RuntimeEnv.from_env()`.

This module and the command-line entry points (`axond.cli`) are the only code that reads `os.environ`
(tests/init/test_config.py checks it). `init_process_group` and each CLI command build one `RuntimeEnv` and pass
it (or the part needed) down: to the store an `init_method` opens, the backend options, the mesh, failure
reporting, metrics and the timeline, the worker's rank environments. A bad value raises `ConfigError` (a
`ValueError`) naming the variable and what it accepts (each value is read by a parser of `axond.env_values`).
docs/environment.md lists every variable.

Backend-specific settings (the tcp backend's AXOND_TCP_* and AXOND_SHM*) are read by the backend's own options
class from `RuntimeEnv.environ`, the snapshot taken here, so that this module knows no backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from axond.env_flags import FALSE, TRUE, flag_on
from axond.env_values import (
    ConfigError, bound_from, nonblank, parse_fraction, parse_hex, parse_int, parse_port, parse_seconds,
)
from axond.launchers import OPEN_MPI_DEFAULTS, LauncherError, launcher_ranks
from axond.observe.settings import ObserveSettings

__all__ = ["ConfigError", "FailureSettings", "MAX_WORLD_SIZE", "OPEN_MPI_DEFAULTS", "RuntimeEnv", "StragglerSettings",
           "WAIT_NOTICE_S",
           "default_state_dir", "export_defaults", "parse_overlap"]

MAX_WORLD_SIZE = 1 << 20
"""Default most ranks a job may have (AXOND_MAX_WORLD_SIZE; the coordinator's own limit is the same)."""
WORLD_SIZE_CAP = (1 << 31) - 1
"""The most AXOND_MAX_WORLD_SIZE may say (rank counts travel as 32-bit fields)."""
FD_CAP = (1 << 31) - 1
"""The largest file descriptor AXOND_SHARD_MEMORY_FD may name."""
MAX_GENERATION = (1 << 63) - 1
"""The largest AXOND_GENERATION (generations travel as 64-bit fields)."""
WAIT_NOTICE_S = 60.0
"""Default seconds between `axond worker`'s "still waiting" notices (AXOND_WAIT_NOTICE_S)."""
OVERLAP_ENV = "AXOND_TORCH_OVERLAP"
MAX_STRAGGLER_WINDOWS = 15
"""The most AXOND_STRAGGLER_WINDOWS may say (windows are built from a group's last 64 marks: `arrivals.KEEP_MARKS`)."""

T = TypeVar("T")


@dataclass(frozen=True)
class FailureSettings:
    """How failures are reported (AXOND_DEBUG, AXOND_ERROR_FILE, AXOND_FR_DUMP_DIR)."""

    debug: bool = False
    """Keep the transport's frames and chained exceptions in `DistributedError` tracebacks (AXOND_DEBUG=1; read
    leniently, where raising is not an option: only an explicit true value turns it on)."""
    error_file: str | None = None
    """Where this rank writes its uncaught exception as JSON (AXOND_ERROR_FILE; the worker sets one per rank)."""
    fr_dump_dir: str | None = None
    """Where this rank writes its Flight Recorder dump when one of its collectives hangs (AXOND_FR_DUMP_DIR; None:
    no dump unless asked, `axond.distributed.diagnostics.flight_recorder`)."""
    survivor_exit_delay_s: float = 0.0
    """Under torchrun (TORCHELASTIC_RUN_ID set, no AXOND_ERROR_FILE): seconds a rank whose failure names another
    rank as its cause waits before it exits, so that torchrun observes the root cause's exit first and names it
    (AXOND_SURVIVOR_EXIT_DELAY_S, default `SURVIVOR_EXIT_DELAY_S`; 0: no wait). Elsewhere 0: `axond worker` names
    the root cause by what each failure blames."""


SURVIVOR_EXIT_DELAY_S = 2.0
"""Default of `FailureSettings.survivor_exit_delay_s` under torchrun: longer than torchrun's 0.1 s monitor interval
and than a failing rank's usual teardown."""


def _survivor_delay(env: Mapping[str, str]) -> float:
    """`FailureSettings.survivor_exit_delay_s` of environment `env` (a bad value: the default; read leniently, as the
    failure path cannot raise)."""
    if not env.get("TORCHELASTIC_RUN_ID") or env.get("AXOND_ERROR_FILE"):
        return 0.0
    raw = env.get("AXOND_SURVIVOR_EXIT_DELAY_S")
    try:
        value = float(raw) if raw else SURVIVOR_EXIT_DELAY_S
    except ValueError:
        return SURVIVOR_EXIT_DELAY_S
    return min(max(value, 0.0), 60.0) if value == value else SURVIVOR_EXIT_DELAY_S


def export_rank_variables(values: Mapping[str, str]) -> None:
    """Set rank variables (RANK, WORLD_SIZE, AXOND_GENERATION, ...) in this process's environment: after
    `axond.reform()`, user code and the next `RuntimeEnv.from_env` read the rank's new place."""
    os.environ.update(values)


def default_state_dir(environ: Mapping[str, str]) -> Path:
    """$AXOND_STATE_DIR, else $XDG_STATE_HOME/axond, else ~/.local/state/axond (of the variables in `environ`)."""
    explicit = environ.get("AXOND_STATE_DIR")
    if explicit:
        return Path(explicit)
    xdg = environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "axond"


def parse_overlap(raw: str | None) -> bool | None:
    """AXOND_TORCH_OVERLAP: True (`1`), False (`0`) or None (`auto`, the default: decided per group)."""
    value = (raw or "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in TRUE or value in FALSE:
        return value in TRUE
    raise ConfigError(f"bad {OVERLAP_ENV}={value!r}: use auto, 1 (async collectives on a communication thread) or 0 "
                      "(on the calling thread)")


def _from_launcher(env: Mapping[str, str], values: dict[str, Any], strict: bool) -> None:
    """Fill the ranks RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE left unset from an MPI launcher's variables."""
    try:
        found = launcher_ranks(env)
    except LauncherError as e:
        if strict:
            raise ConfigError(str(e)) from e
        return
    if found is None:
        return
    values["launcher"] = found.launcher
    for name in ("rank", "world_size", "local_rank", "local_world_size"):
        if getattr(found, name) is not None:
            values.setdefault(name, getattr(found, name))


@dataclass(frozen=True)
class StragglerSettings:
    """How ranks time their collectives and when a rank is named a straggler (docs/operations.md, "Stragglers")."""

    window_ops: int = 8
    """AXOND_STRAGGLER_WINDOW_OPS: collectives between two marks of a group's total wait (0: no recording)."""
    window_s: float = 0.3
    """AXOND_STRAGGLER_WINDOW_MS (read in ms): the least wall time of a compared window (a run of marks): a step."""
    windows: int = 3
    """AXOND_STRAGGLER_WINDOWS: consecutive windows a rank must wait far less than the others to be named."""
    threshold_s: float = 0.05
    """AXOND_STRAGGLER_THRESHOLD_MS (read in ms): the least the others' median wait must exceed a rank's per window."""
    fraction: float = 0.1
    """AXOND_STRAGGLER_FRACTION: ...and the least share of the window's wall time that gap must be."""

    @classmethod
    def read(cls, env: Mapping[str, str], strict: bool) -> StragglerSettings:
        values: dict[str, Any] = {}
        parsers: dict[str, tuple[str, Callable[[str, str], Any]]] = {
            "window_ops": ("AXOND_STRAGGLER_WINDOW_OPS", lambda var, raw: parse_int(var, raw, 0, 1 << 30)),
            "window_s": ("AXOND_STRAGGLER_WINDOW_MS", lambda var, raw: parse_seconds(var, raw) / 1000.0),
            "windows": ("AXOND_STRAGGLER_WINDOWS", lambda var, raw: parse_int(var, raw, 1, MAX_STRAGGLER_WINDOWS)),
            "threshold_s": ("AXOND_STRAGGLER_THRESHOLD_MS", lambda var, raw: parse_seconds(var, raw) / 1000.0),
            "fraction": ("AXOND_STRAGGLER_FRACTION", parse_fraction),
        }
        for name, (var, parse) in parsers.items():
            raw = nonblank(env.get(var))
            if raw is None:
                continue
            try:
                values[name] = parse(var, raw)
            except ConfigError:
                if strict:
                    raise
        return cls(**values)



@dataclass(frozen=True)
class RuntimeEnv:
    """Every environment variable the library and the daemons use, parsed (docs/environment.md says what each means).

    Build it with `from_env`; fields left at their defaults mean "not set". Tests build one from a dict:
    `RuntimeEnv.from_env({"RANK": "0", "WORLD_SIZE": "1"})`.
    """

    environ: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    """The whole environment as read (read-only): the base of a child process's environment, and what a backend's
    own options class (`TcpOptions.from_env`) reads its variables from."""
    # -- set by the launcher (torchrun's names)
    rank: int | None = None
    """RANK: this process's global rank."""
    world_size: int | None = None
    """WORLD_SIZE: ranks in the job."""
    local_rank: int | None = None
    """LOCAL_RANK: index of this rank on its node (also the GPU the nccl backend uses)."""
    local_world_size: int | None = None
    """LOCAL_WORLD_SIZE: ranks on this node."""
    max_world_size: int = MAX_WORLD_SIZE
    """AXOND_MAX_WORLD_SIZE: the most ranks WORLD_SIZE (or `world_size=`) may say."""
    launcher: str | None = None
    """The MPI launcher whose variables gave the ranks not set above (`axond.launchers`; e.g. OMPI_COMM_WORLD_RANK
    under `mpirun`), or None: no MPI launcher started this process."""
    master_addr: str | None = None
    """MASTER_ADDR: host of the rendezvous TCP store."""
    master_port: int | None = None
    """MASTER_PORT: its port."""
    agent_store: bool = False
    """TORCHELASTIC_USE_AGENT_STORE=True: the launcher serves that store; every rank is its client."""
    elastic_run_id: str | None = None
    """TORCHELASTIC_RUN_ID: torchrun's job name."""
    restart_count: str | None = None
    """TORCHELASTIC_RESTART_COUNT: restarts so far (kept as given: it only names key prefixes)."""
    # -- the axond job
    coordinator: str = ""
    """AXOND_COORDINATOR: HOST:PORT of the coordinator (or of its replicas, comma-separated); "" if unset."""
    job: str = "default"
    """AXOND_JOB: the job's name."""
    generation: int = 1
    """AXOND_GENERATION: the restart generation."""
    job_secret: bytes = b""
    """AXOND_JOB_SECRET (hex): the generation's data-plane secret."""
    file_store: str | None = None
    """AXOND_FILE_STORE: a directory for a one-host FileStore rendezvous."""
    live_recovery: bool = False
    """AXOND_LIVE_RECOVERY: the job recovers live (`axond worker --live-recovery` sets it in every rank)."""
    membership_file: str | None = None
    """AXOND_MEMBERSHIP_FILE: where the worker tells this rank of a live re-formation and of its new place."""
    live_wait_s: float = 30.0
    """AXOND_LIVE_WAIT_S: seconds a rank whose collective failed in a live job waits for the worker's word of the
    next generation (then `MembershipChanged`) before it raises the failure as it is."""
    live_max_world: int = 0
    """AXOND_LIVE_MAX_WORLD: the most ranks the live job may grow to (`--nnodes` MAX x `--nproc-per-node`, set by the
    worker; 0: unknown): `DistributedTrainer`'s default number of virtual ranks there."""
    shard_memory_fd: int | None = None
    """AXOND_SHARD_MEMORY_FD: a file descriptor (inherited from the worker) of the shared memory the worker daemon
    keeps for this local rank: ZeRO-1's copies of the rank's shards there outlive the rank
    (`axond.train.daemon_copy`)."""
    held_memory_fd: int | None = None
    """AXOND_HELD_MEMORY_FD: a file descriptor (inherited from the worker) of the node's held memory: the buddy copies
    other nodes' ranks sent this node's worker (`axond.train.relay`)."""
    copy_forward_fd: int | None = None
    """AXOND_COPY_FORWARD_FD: a file descriptor (inherited from the worker) of the pipe through which this rank asks
    its worker to send its buddy copy to the buddy's worker (`axond.train.relay`)."""
    copy_relay: str | None = None
    """AXOND_COPY_RELAY: host:port of this node's worker's relay, where other nodes' ranks send their buddy copies."""
    # -- reaching the coordinator
    token: str | None = None
    """AXOND_TOKEN."""
    token_file: str | None = None
    """AXOND_TOKEN_FILE."""
    tls_ca: str | None = None
    """AXOND_TLS_CA."""
    tls_cert: str | None = None
    """AXOND_TLS_CERT: client certificate of mutual TLS."""
    tls_key: str | None = None
    """AXOND_TLS_KEY: its key."""
    state_dir: Path = field(default_factory=lambda: Path.home() / ".local" / "state" / "axond")
    """AXOND_STATE_DIR, else $XDG_STATE_HOME/axond, else ~/.local/state/axond: the coordinator's default state
    directory (where clients on this machine find its generated token)."""
    # -- network
    socket_ifname: str | None = None
    """AXOND_SOCKET_IFNAME: advertise and listen on this interface's address."""
    # -- reporting
    failure: FailureSettings = field(default_factory=FailureSettings)
    """AXOND_DEBUG, AXOND_ERROR_FILE and AXOND_FR_DUMP_DIR."""
    observe: ObserveSettings = field(default_factory=ObserveSettings)
    """AXOND_METRICS_DIR and AXOND_TIMELINE."""
    # -- the torch backend
    torch_overlap: bool | None = None
    """AXOND_TORCH_OVERLAP: True (1), False (0), None (auto)."""
    torch_backend: str | None = None
    """AXOND_TORCH_BACKEND: the axond backend the torch backend's groups run on (None: the registry's default)."""
    # -- the worker
    torch_store: bool = True
    """AXOND_TORCH_STORE: False (0) when the worker must serve no torch TCPStore for its ranks."""
    wait_notice_s: float = WAIT_NOTICE_S
    """AXOND_WAIT_NOTICE_S: seconds between the worker's "still waiting" notices (0: never)."""
    stragglers: StragglerSettings = field(default_factory=StragglerSettings)
    """AXOND_STRAGGLER_*: collective timing windows and when a rank is named a straggler."""
    nccl_async_error_handling: str = "1"
    """TORCH_NCCL_ASYNC_ERROR_HANDLING as the worker passes it on to its ranks (torchrun's default: 1)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, strict: bool = True) -> RuntimeEnv:
        """Read every variable of `environ` (default: this process's environment) once.

        A bad value raises `ConfigError` naming the variable and what it accepts; with `strict=False` (for
        `import axond`, where raising is not an option) it is left at its default instead, and raises where
        a strict read is made (`init_process_group`, the CLI).
        """
        env: dict[str, str] = dict(os.environ if environ is None else environ)
        values: dict[str, Any] = {}

        def read(name: str, var: str, parse: Callable[[str, str], T]) -> None:
            raw = nonblank(env.get(var))
            if raw is None:
                return
            try:
                values[name] = parse(var, raw)
            except ConfigError:
                if strict:
                    raise

        read("max_world_size", "AXOND_MAX_WORLD_SIZE", lambda var, raw: parse_int(var, raw, 1, WORLD_SIZE_CAP))
        most = values.get("max_world_size", MAX_WORLD_SIZE)
        limit = f" (at most AXOND_MAX_WORLD_SIZE={most}; raise that for a larger job)"
        read("world_size", "WORLD_SIZE", lambda var, raw: parse_int(var, raw, 1, most, limit))
        read("local_world_size", "LOCAL_WORLD_SIZE", lambda var, raw: parse_int(
            var, raw, 1, values.get("world_size", most), bound_from("WORLD_SIZE", values, "at most")))
        read("rank", "RANK", lambda var, raw: parse_int(
            var, raw, 0, values.get("world_size", most) - 1, bound_from("WORLD_SIZE", values, "below")))
        read("local_rank", "LOCAL_RANK", lambda var, raw: parse_int(
            var, raw, 0, values.get("local_world_size", most) - 1, bound_from("LOCAL_WORLD_SIZE", values, "below")))
        read("master_port", "MASTER_PORT", parse_port)
        read("generation", "AXOND_GENERATION", lambda var, raw: parse_int(var, raw, 0, MAX_GENERATION))
        read("job_secret", "AXOND_JOB_SECRET", parse_hex)
        read("wait_notice_s", "AXOND_WAIT_NOTICE_S", parse_seconds)
        read("live_wait_s", "AXOND_LIVE_WAIT_S", parse_seconds)
        read("live_max_world", "AXOND_LIVE_MAX_WORLD", lambda var, raw: parse_int(var, raw, 0, WORLD_SIZE_CAP))
        read("shard_memory_fd", "AXOND_SHARD_MEMORY_FD", lambda var, raw: parse_int(var, raw, 0, FD_CAP))
        read("held_memory_fd", "AXOND_HELD_MEMORY_FD", lambda var, raw: parse_int(var, raw, 0, FD_CAP))
        read("copy_forward_fd", "AXOND_COPY_FORWARD_FD", lambda var, raw: parse_int(var, raw, 0, FD_CAP))
        read("torch_overlap", OVERLAP_ENV, lambda var, raw: parse_overlap(raw))
        for name, var in (("master_addr", "MASTER_ADDR"), ("elastic_run_id", "TORCHELASTIC_RUN_ID"),
                          ("restart_count", "TORCHELASTIC_RESTART_COUNT"), ("job", "AXOND_JOB"),
                          ("file_store", "AXOND_FILE_STORE"), ("token", "AXOND_TOKEN"),
                          ("token_file", "AXOND_TOKEN_FILE"), ("tls_ca", "AXOND_TLS_CA"),
                          ("tls_cert", "AXOND_TLS_CERT"), ("tls_key", "AXOND_TLS_KEY"),
                          ("socket_ifname", "AXOND_SOCKET_IFNAME"), ("coordinator", "AXOND_COORDINATOR"),
                          ("copy_relay", "AXOND_COPY_RELAY"),
                          ("torch_backend", "AXOND_TORCH_BACKEND"), ("membership_file", "AXOND_MEMBERSHIP_FILE"),
                          ("nccl_async_error_handling", "TORCH_NCCL_ASYNC_ERROR_HANDLING")):
            raw = nonblank(env.get(var))
            if raw is not None:
                values[name] = raw
        _from_launcher(env, values, strict)
        return cls(
            environ=MappingProxyType(env),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            state_dir=default_state_dir(env),
            failure=FailureSettings(debug=flag_on(env.get("AXOND_DEBUG")),
                                    error_file=nonblank(env.get("AXOND_ERROR_FILE")),
                                    fr_dump_dir=nonblank(env.get("AXOND_FR_DUMP_DIR")),
                                    survivor_exit_delay_s=_survivor_delay(env)),
            observe=ObserveSettings.from_env(env),
            stragglers=StragglerSettings.read(env, strict),
            torch_store=env.get("AXOND_TORCH_STORE", "1") != "0",
            live_recovery=flag_on(env.get("AXOND_LIVE_RECOVERY")),
            **values,
        )

    def with_vars(self, **variables: str) -> RuntimeEnv:
        """This environment with `variables` set (e.g. what a worker adds for its ranks), read again."""
        return RuntimeEnv.from_env({**self.environ, **variables})


def export_defaults(defaults: Mapping[str, str]) -> None:
    """Set each variable of `defaults` that this process's environment leaves unset: settings of a library loaded next
    that reads them when it starts (Open MPI's OMPI_MCA_* before mpi4py starts MPI, `axond.launchers`)."""
    for var, value in defaults.items():
        os.environ.setdefault(var, value)
