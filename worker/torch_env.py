"""torchrun's variables for the ranks, and the torch TCPStore the worker serves on MASTER_PORT (as torchrun's agent).

A script written for torchrun (`torch.distributed.init_process_group("gloo")`, env://) reads MASTER_ADDR,
MASTER_PORT and the TORCHELASTIC_* names. When torch is importable here, node rank 0 of each generation serves a
real `torch.distributed.TCPStore` (a fresh one per generation, so a restart never sees the previous attempt's
keys) and publishes its address in the generation's coordinator store; every node's ranks get it as
MASTER_ADDR:MASTER_PORT with TORCHELASTIC_USE_AGENT_STORE=True, so that every rank is a client, exactly as under
torchrun. Without torch only the names that need no store are set. AXOND_TORCH_STORE=0 turns the store off.
"""

from __future__ import annotations

import importlib.util
import select
import socket
import threading
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from axond.config import RuntimeEnv
from axond.errors import StoreError
from axond.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient

MASTER_KEY = "axond/torch-master"
"""Key of the generation's coordinator store holding node rank 0's "HOST:PORT" ("" when it serves none)."""
MASTER_WAIT_S = 120.0
"""Seconds a node other than rank 0 waits for node rank 0 to publish its store's address."""
ROLE_NAME = "default"
"""torchrun's default role name."""


def wanted(allowed: bool = True) -> bool:
    """Whether to serve torch's store: torch importable here and `allowed` (AXOND_TORCH_STORE not "0")."""
    if not allowed:
        return False
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def route_host(coordinator: str) -> str:
    """This machine's address on the route to the coordinator (what other nodes reach it at), else loopback."""
    host = urlsplit("//" + coordinator.split(",")[0]).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class AgentStore:
    """The torch TCPStore one generation's ranks rendezvous over, served by node rank 0.

    The port is bound at once (so the address can be handed out), but torch is imported and its server started
    only when the first client connects (torch's `master_listen_fd`): a job whose ranks never use torch costs the
    worker nothing. The pending connection waits in the listen backlog meanwhile.
    """

    def __init__(self, allowed: bool = True) -> None:
        self._allowed = allowed
        """False when AXOND_TORCH_STORE=0 turned the store off."""
        self.address = ""
        self.error = ""
        self._store: Any = None
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self, client: CoordinatorClient, job: str, joined: pb.JoinResponse, coordinator: str) -> str:
        """Node rank 0: serve a store (if torch is installed here) and publish its address; other nodes: read it.
        Returns "HOST:PORT", or "" when no store is served for this generation."""
        kv = client.store(job, joined.generation)
        if joined.node_rank != 0:
            try:
                self.address = kv.get(MASTER_KEY, MASTER_WAIT_S).decode()
            except StoreError:
                self.address = ""
            return self.address
        if wanted(self._allowed):
            host = route_host(coordinator)  # only that address: loopback for a coordinator on this machine
            self._listener = socket.create_server((host, 0), backlog=1024)
            self.address = f"{host}:{self._listener.getsockname()[1]}"
            self._thread = threading.Thread(target=self._serve_on_demand, name="axond-torch-store", daemon=True)
            self._thread.start()
        kv.set(MASTER_KEY, self.address.encode())  # "" tells the other nodes not to wait for a store
        return self.address

    def _serve_on_demand(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stop.is_set():
            ready, _, _ = select.select([listener], [], [], 0.2)
            if ready:
                break
        else:
            return
        try:
            from torch.distributed import TCPStore

            host, port = listener.getsockname()[:2]
            self._store = TCPStore(host, port, None, True, wait_for_workers=False, master_listen_fd=listener.fileno())
            listener.detach()  # torch's server owns the descriptor now
        except Exception as e:  # noqa: BLE001 - a broken torch must not take the worker down; the ranks time out
            self.error = f"torch's TCPStore could not start: {type(e).__name__}: {e}"

    def close(self) -> None:
        """Stop serving (torch stops its server with the last reference)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30.0)
        self._store = None
        if self._listener is not None:
            self._listener.close()  # a no-op once detached


def torchrun_env(joined: pb.JoinResponse, job: str, max_restarts: int, master: str,
                 worker_env: RuntimeEnv | None = None) -> dict[str, str]:
    """The variables torchrun's agent sets that are the same for every local rank (RANK/LOCAL_RANK/ROLE_RANK
    are per rank: see `rank_env`); TORCH_NCCL_ASYNC_ERROR_HANDLING as `worker_env` has it, else 1."""
    restart_count = max(max_restarts - joined.restarts_left, 0)
    env = {
        "GROUP_RANK": str(joined.node_rank),
        "GROUP_WORLD_SIZE": str(joined.nnodes),
        "ROLE_NAME": ROLE_NAME,
        "ROLE_WORLD_SIZE": str(joined.world_size),
        "LOCAL_WORLD_SIZE": str(joined.local_world_size),
        "WORLD_SIZE": str(joined.world_size),
        "TORCHELASTIC_RUN_ID": job,
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": worker_env.nccl_async_error_handling if worker_env is not None else "1",
    }
    if master:
        host, _, port = master.rpartition(":")
        env.update(MASTER_ADDR=host, MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True")
    return env


def rank_env(rank: int, local_rank: int) -> dict[str, str]:
    """The per-rank torchrun variables."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "ROLE_RANK": str(rank)}
