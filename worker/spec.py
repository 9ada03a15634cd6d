"""Options of the worker: where the coordinator is, and what job to run and how."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from axond.config import RuntimeEnv
from axond.control.client import connect
from axond.control.channel import normalize_address
from axond.control.credentials import resolve_token

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient


DEFAULT_OUTAGE_GRACE_S = 60.0
"""How long a job's ranks keep running, by default, while the coordinator does not answer."""


@dataclass(frozen=True)
class ConnectOptions:
    """How to reach the coordinator; also handed on to the rank processes."""

    address: str
    """HOST:PORT of the coordinator."""
    token: str | None = None
    """Shared secret the coordinator was started with, if any."""
    tls_ca: str | None = None
    """PEM file of the CA that signed the coordinator's certificate, when it serves TLS."""
    call_timeout: float = 10.0
    """Seconds any single control-plane call may take (long polls add their own wait)."""
    connect_wait: float = 0.0
    """Seconds to keep trying a coordinator that is not listening yet (it may be starting)."""
    on_wait: Callable[[str], None] | None = field(default=None, compare=False)
    """Receives one line when the client starts waiting for the coordinator."""
    env: RuntimeEnv = field(default_factory=RuntimeEnv.from_env, compare=False)
    """The worker's environment, read once by the CLI: credentials it names, the base of the ranks' environment, and
    the worker's settings (AXOND_TORCH_STORE, AXOND_WAIT_NOTICE_S, AXOND_SOCKET_IFNAME); read when made if not given."""

    def connect(self) -> CoordinatorClient:
        """Open a client to the coordinator (raises `axond.CoordinatorError` on bad options)."""
        return connect(
            self.address, token=self.token, tls_ca=self.tls_ca, call_timeout=self.call_timeout,
            connect_wait=self.connect_wait, on_wait=self.on_wait, env=self.env,
        )

    def rank_env(self) -> dict[str, str]:
        """The variables a rank needs to reach the same coordinator (the token as this worker found it)."""
        env = {"AXOND_COORDINATOR": self.address}
        token = resolve_token(normalize_address(self.address), self.token, env=self.env)
        if token:
            env["AXOND_TOKEN"] = token
        if self.tls_ca:
            env["AXOND_TLS_CA"] = self.tls_ca
        return env


@dataclass(frozen=True)
class JobSpec:
    """A job as one node takes part in it: the command, the rendezvous bounds and restarts."""

    argv: tuple[str, ...]
    """Command every local rank runs."""
    job: str = "default"
    """Job name; every worker of one job uses the same name."""
    nproc_per_node: int = 1
    """Local rank processes on this node."""
    min_nodes: int = 1
    """The rendezvous freezes once at least this many nodes joined (and the settle time passed)."""
    max_nodes: int = 1
    """The rendezvous freezes at once when this many nodes joined."""
    max_restarts: int = 0
    """Times the whole job restarts after a failure anywhere before it fails."""
    env: Mapping[str, str] | None = None
    """Extra environment for the ranks (on top of the worker's own)."""
    cwd: str | None = None
    """Working directory of the ranks (None: the worker's)."""
    join_timeout: float = 300.0
    """Seconds to wait for the rendezvous to freeze before giving up."""
    stop_grace: float = 5.0
    """Seconds between SIGTERM and SIGKILL when stopping ranks."""
    node_rank: int | None = None
    """torchrun's --node-rank, if given: the rendezvous assigns node ranks; a different one is reported."""
    outage_grace: float = DEFAULT_OUTAGE_GRACE_S
    """Seconds the ranks keep running while the coordinator is away (not while this node is cut off from it)."""
    live_recovery: bool = False
    """Another node's failure re-forms the job around the survivors, whose ranks keep running
    (docs/live-recovery.md)."""

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("no command to run: pass it after `--`, e.g. `axond worker ... -- python train.py`")
        if not self.job:
            raise ValueError("the job name must not be empty")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"need 1 <= min nodes <= max nodes, got {self.min_nodes}:{self.max_nodes}; "
                "pass --nnodes N or --nnodes MIN:MAX"
            )
        if self.max_restarts < 0:
            raise ValueError(f"max-restarts must be >= 0, got {self.max_restarts}")
        if self.join_timeout <= 0 or self.stop_grace < 0:
            raise ValueError("join timeout must be > 0 and stop grace >= 0")
        if not self.outage_grace >= 0:
            raise ValueError(f"--outage-grace must be >= 0 seconds, got {self.outage_grace}")


def parse_nnodes(text: str) -> tuple[int, int]:
    """Parse `N` or `MIN:MAX` into (min_nodes, max_nodes)."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError(text)
    except ValueError as e:
        raise ValueError(f"--nnodes takes N or MIN:MAX (e.g. 2 or 1:4), got {text!r}") from e
    if not 1 <= lo <= hi:
        raise ValueError(f"--nnodes needs 1 <= MIN <= MAX, got {text!r}")
    return lo, hi
