"""Where `init_process_group` finds the job's KV store: torch's `init_method` URLs and axond's environment.

`env://` (the default) takes the first of: the coordinator (AXOND_COORDINATOR, what `axond worker` sets),
a FileStore directory (AXOND_FILE_STORE), or a store at MASTER_ADDR:MASTER_PORT: the launcher's own torch
TCPStore when TORCHELASTIC_USE_AGENT_STORE=True (what torchrun and `axond worker` set; every rank is a client),
else a `TCPStore` served by rank 0; else, under an MPI launcher (`mpirun`), rank 0's TCPStore on a free port, its
address and a job secret broadcast through MPI (`axond.store.mpi_rendezvous`). `tcp://host:port` is that TCPStore
at an explicit address, `file://path` a FileStore in directory `path`, `axond://host:port` the coordinator at that
address. Timeouts may be seconds or a `datetime.timedelta`, as torch's are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import parse_qs, urlsplit

from axond.config import RuntimeEnv
from axond.errors import DistributedError, StoreError
from axond.store.base import Store
from axond.store.file import FileStore
from axond.store.mpi_rendezvous import mpi_store
from axond.store.tcp import TCPStore
from axond.store.torch_agent import TorchAgentStore, agent_prefix

SCHEMES = ("env", "tcp", "file", "axond")
SERVER_LINGER = 30.0
"""Seconds rank 0 keeps serving a TCPStore at destroy while other ranks are still connected."""


def seconds(timeout: float | timedelta, what: str = "timeout") -> float:
    """`timeout` (seconds or a timedelta) as positive float seconds, or ValueError saying what to pass."""
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise TypeError(f"{what} must be seconds (a number) or a datetime.timedelta, got {timeout!r}")
    if not value > 0:
        raise ValueError(f"{what} must be positive seconds, got {timeout!r} (a number or a datetime.timedelta)")
    return value


@dataclass(frozen=True)
class InitMethod:
    """A parsed `init_method` URL."""

    scheme: str
    """One of SCHEMES."""
    host: str = ""
    """Host of tcp:// and axond:// URLs."""
    port: int = 0
    """Port of tcp:// and axond:// URLs."""
    path: str = ""
    """Directory of a file:// URL."""
    params: dict[str, str] = field(default_factory=dict)
    """Query parameters (torch's `?rank=..&world_size=..`)."""


def parse(url: str) -> InitMethod:
    """Parse `url` ("env://", "tcp://host:port", "file:///dir", "axond://host:port"), or ValueError."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"init_method {url!r}: unknown scheme; use env://, tcp://HOST:PORT, file:///DIR "
                         "or axond://COORDINATOR:PORT")
    params = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if scheme == "file":
        path = parts.path or parts.netloc
        if not path:
            raise ValueError(f"init_method {url!r}: file:// needs a directory, e.g. file:///tmp/job-store")
        return InitMethod(scheme, path=path, params=params)
    if scheme in ("tcp", "axond"):
        try:
            host, port = parts.hostname, parts.port
        except ValueError as e:
            raise ValueError(f"init_method {url!r}: the port is not a number") from e
        if not host or not port:
            raise ValueError(f"init_method {url!r}: {scheme}:// needs HOST:PORT, e.g. {scheme}://10.0.0.1:29500")
        return InitMethod(scheme, host=host, port=port, params=params)
    return InitMethod(scheme, params=params)


@dataclass
class OpenedStore:
    """A store opened for the default group and what closes it."""

    store: Store
    closers: list[Callable[[], None]] = field(default_factory=list)
    master_addr: str | None = None
    """Rank 0's host when the rendezvous found it (through MPI), for the data plane's route; None: as configured."""
    secret: bytes | None = None
    """The job secret the rendezvous agreed on (through MPI), or None: the configured one."""


def open_store(method: InitMethod, rank: int, size: int, timeout: float, secret: bytes,
               env: RuntimeEnv | None = None) -> OpenedStore:
    """Open the store `method` names for global rank `rank` of `size` (rank 0 serves a TCPStore); `env://` and the
    coordinator's credentials from `env` (default: nothing set)."""
    env = env if env is not None else RuntimeEnv()
    if method.scheme == "tcp":
        return _tcp_store(method.host, method.port, rank, timeout, secret, f"tcp://{method.host}:{method.port}")
    if method.scheme == "file":
        files = FileStore(method.path)
        return OpenedStore(files, [files.close])
    if method.scheme == "axond":
        return coordinator_store(f"{method.host}:{method.port}", env)
    if env.coordinator:
        return coordinator_store(env.coordinator, env)
    if env.file_store:
        files = FileStore(env.file_store)
        return OpenedStore(files, [files.close])
    addr, port = env.master_addr, env.master_port
    if addr and port is not None:
        if env.agent_store:
            return _agent_store(addr, port, size, timeout, agent_prefix(env.elastic_run_id, env.restart_count))
        return _tcp_store(addr, port, rank, timeout, secret, f"MASTER_ADDR:MASTER_PORT ({addr}:{port})")
    if env.launcher is not None:
        return _through_mpi(rank, size, timeout, env)
    missing = "MASTER_PORT" if addr else "MASTER_ADDR" if port is not None else "MASTER_ADDR and MASTER_PORT"
    raise DistributedError("init_process_group: no store; set AXOND_COORDINATOR (what `axond worker` does), "
                           f"or {missing} (what torchrun does; rank 0 serves the store), start the ranks with mpirun "
                           "(with mpi4py installed), AXOND_FILE_STORE=<shared dir> for single-host runs, or pass "
                           "store=... or init_method=...")


def _tcp_store(host: str, port: int, rank: int, timeout: float, secret: bytes, where: str) -> OpenedStore:
    try:
        store = TCPStore(host, port, is_server=rank == 0, timeout=timeout, secret=secret)
    except OSError as e:
        raise DistributedError(f"init_process_group: rank 0 cannot serve the store on {where}: {e}; if a launcher "
                               "serves a store there, it sets TORCHELASTIC_USE_AGENT_STORE=True (torchrun and "
                               "`axond worker` do); else pick a free MASTER_PORT") from e
    except StoreError as e:
        raise DistributedError(f"init_process_group: rank {rank} cannot reach the store on {where}: {e}") from e
    if rank == 0:
        return OpenedStore(store, [lambda: store.close(linger=min(timeout, SERVER_LINGER))])
    return OpenedStore(store, [store.close])


def _through_mpi(rank: int, size: int, timeout: float, env: RuntimeEnv) -> OpenedStore:
    """Started by an MPI launcher with no rendezvous set: rank 0's store, found through MPI (`mpi_rendezvous`)."""
    store, host, secret = mpi_store(rank, size, timeout, env)
    linger = min(timeout, SERVER_LINGER) if rank == 0 else 0.0
    return OpenedStore(store, [lambda: store.close(linger=linger)], host, secret)


def _agent_store(host: str, port: int, size: int, timeout: float, prefix: str) -> OpenedStore:
    """A client of the torch TCPStore the launcher (torchrun's agent, `axond worker`) serves on MASTER_PORT."""
    try:
        store = TorchAgentStore(host, port, size, timeout, prefix=prefix)
    except StoreError as e:
        raise DistributedError(f"init_process_group: {e}") from e
    return OpenedStore(store, [store.close])


def open_job_store(env: RuntimeEnv) -> OpenedStore | None:
    """The store of this rank's job generation at the coordinator (AXOND_COORDINATOR, AXOND_JOB, AXOND_GENERATION:
    what `axond worker` sets), or None outside an axond job."""
    return coordinator_store(env.coordinator, env) if env.coordinator else None


def coordinator_store(address: str, env: RuntimeEnv) -> OpenedStore:
    """The KV store of the job generation `env` names (AXOND_JOB, AXOND_GENERATION), served by the coordinator at
    `address`, with the client that serves it among its closers."""
    from axond.control import client

    conn = client.connect(address, token=env.token, tls_ca=env.tls_ca, env=env)
    store = conn.store(env.job, env.generation)
    return OpenedStore(store, [store.close, conn.close])
