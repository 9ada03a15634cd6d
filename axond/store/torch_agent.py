"""`TorchAgentStore`: the native API's client of torch's own TCPStore, the store a launcher's agent serves.

torchrun's agent (and `axond worker`, when torch is installed) serves a `torch.distributed.TCPStore` on
MASTER_ADDR:MASTER_PORT and tells the ranks so with TORCHELASTIC_USE_AGENT_STORE=True: every rank, rank 0
too, is then a client of that store, and none may serve one of its own on the same port. This adapter
gives axond's `Store` interface over torch's client (torch is imported only here, only then). Keys live
under `axond/<run id>/attempt-<restart count>/`, so a restarted attempt never reads the previous one's keys.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from axond.errors import DistributedError, StoreError
from axond.store.over_torch import AxondStoreOverTorch


def agent_prefix(run_id: str | None, restart_count: str | None) -> str:
    """This attempt's key prefix (run id and restart count: torchrun's TORCHELASTIC_RUN_ID and
    TORCHELASTIC_RESTART_COUNT)."""
    return f"axond/{run_id or 'none'}/attempt-{restart_count or '0'}/"


class TorchAgentStore(AxondStoreOverTorch):
    """A `Store` over a client of the torch TCPStore at `host:port` (no server is started here)."""

    def __init__(self, host: str, port: int, world_size: int, timeout: float, prefix: str = "") -> None:
        try:
            from torch.distributed import TCPStore
        except ImportError as e:
            raise DistributedError(
                "init_process_group: the launcher serves torch's TCPStore (TORCHELASTIC_USE_AGENT_STORE=True) "
                "but torch is not importable in this rank; install axond[torch] or unset the variable") from e
        self.address = f"{host}:{port}"
        self.timeout = timeout
        try:
            store: Any = TCPStore(host, port, world_size, False, timedelta(seconds=timeout))
        except Exception as e:  # torch raises DistNetworkError / RuntimeError
            raise StoreError(f"cannot reach the launcher's TCPStore at {self.address} within {timeout:.0f} s: "
                             f"{e}; is the launcher (torchrun, axond worker) still running?") from e
        super().__init__(store, prefix, f"TCP store at {self.address}")

    def close(self) -> None:
        """Nothing to stop: the server is the launcher's; torch closes the client's socket with the object."""
