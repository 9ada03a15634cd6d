"""`TorchAgentStore`: the native API's client of torch's own TCPStore, the store a launcher's agent serves.

torchrun's agent (and `axond worker`, when torch is installed) serves a `torch.distributed.TCPStore` on
MASTER_ADDR:MASTER_PORT and tells the ranks so with TORCHELASTIC_USE_AGENT_STORE=True: every rank, rank 0
too, is then a client of that store, and none may serve one of its own on the same port. This adapter
gives axond's `Store` interface over torch's client (torch is imported only here, only then). Keys live
under `axond/<run id>/attempt-<restart count>/`, so a restarted attempt never reads the previous one's keys.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from axond.errors import DistributedError, StoreError, StoreTimeout
from axond.store.base import MAX_VALUE_BYTES, Store


def use_agent_store() -> bool:
    """Whether the launcher serves the store itself (torchrun's TORCHELASTIC_USE_AGENT_STORE=True)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def agent_prefix() -> str:
    """This attempt's key prefix (run id and restart count from torchrun's variables)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or "none"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return f"axond/{run}/attempt-{attempt}/"


def _timeout_error(e: Exception) -> bool:
    return "timeout" in str(e).lower() or "timed out" in str(e).lower()


class TorchAgentStore(Store):
    """A `Store` over a client of the torch TCPStore at `host:port` (no server is started here)."""

    def __init__(self, host: str, port: int, world_size: int, timeout: float, prefix: str = "") -> None:
        try:
            from torch.distributed import TCPStore
        except ImportError as e:
            raise DistributedError(
                "init_process_group: the launcher serves torch's TCPStore (TORCHELASTIC_USE_AGENT_STORE=True) "
                "but torch is not importable in this rank; install axond[torch] or unset the variable") from e
        self.address = f"{host}:{port}"
        self.prefix = prefix
        self.timeout = timeout
        try:
            self._store: Any = TCPStore(host, port, world_size, False, timedelta(seconds=timeout))
        except Exception as e:  # torch raises DistNetworkError / RuntimeError
            raise StoreError(f"cannot reach the launcher's TCPStore at {self.address} within {timeout:.0f} s: "
                             f"{e}; is the launcher (torchrun, axond worker) still running?") from e

    def _k(self, key: str) -> str:
        if not key:
            raise StoreError("store key must be a non-empty string")
        return self.prefix + key

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (StoreError, ValueError, TypeError):
            raise
        except Exception as e:  # torch's DistStoreError, DistNetworkError, RuntimeError
            if _timeout_error(e):
                raise StoreTimeout(f"TCP store at {self.address}: {what} timed out: {e}") from e
            raise StoreError(f"TCP store at {self.address}: {what} failed ({e}); the launcher serving it may "
                             "have exited") from e

    def set(self, key: str, value: bytes) -> None:
        if len(value) > MAX_VALUE_BYTES:
            raise StoreError(f"store value for {key!r} is {len(value)} bytes; the limit is {MAX_VALUE_BYTES}")
        self._call("set", self._store.set, self._k(key), bytes(value))

    def get(self, key: str, timeout: float) -> bytes:
        self.wait([key], timeout)
        return bytes(self._call("get", self._store.get, self._k(key)))

    def try_get(self, key: str) -> bytes | None:
        k = self._k(key)
        if not self._call("check", self._store.check, [k]):
            return None
        return bytes(self._call("get", self._store.get, k))

    def add(self, key: str, delta: int) -> int:
        return int(self._call("add", self._store.add, self._k(key), int(delta)))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        k = self._k(key)
        if expected is None and self._call("check", self._store.check, [k]):
            return False, bytes(self._call("get", self._store.get, k))
        current = bytes(self._call("compare_set", self._store.compare_set, k, expected or b"", bytes(desired)))
        return current == bytes(desired), current

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", self._store.delete_key, self._k(key)))

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        if not keys:
            return
        self._call(f"wait for {list(keys)[:4]}", self._store.wait, [self._k(k) for k in keys],
                   timedelta(seconds=timeout))

    def close(self) -> None:
        """Nothing to stop: the server is the launcher's; torch closes the client's socket with the object."""
