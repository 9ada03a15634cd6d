"""axond `Store`s over torch stores: `AxondStoreOverTorch` (any torch store object) and `TorchAgentStore`.

`TorchAgentStore` is the native API's client of torch's own TCPStore, the store a launcher's agent serves.

torchrun's agent (and `axond worker`, when torch is installed) serves a `torch.distributed.TCPStore` on
MASTER_ADDR:MASTER_PORT and tells the ranks so with TORCHELASTIC_USE_AGENT_STORE=True: every rank, rank 0
too, is then a client of that store, and none may serve one of its own on the same port. This adapter
gives axond's `Store` interface over torch's client (torch is imported only here, only then). Keys live
under `axond/<run id>/attempt-<restart count>/`, so a restarted attempt never reads the previous one's keys.

Torch's stores keep a smaller contract than axond's, which the adapter makes up for: an unset key and an empty
value look alike to torch's compare_set, and its server drops the connection of an `add` to a non-integer; so
compare_set and add read the key first (one more round trip; a write racing between that read and the change
can still see torch's semantics). Torch's `set` returns before the server has it, so `set` asks one more
question on the same connection: when it returns, every client sees the value. A zero wait looks instead of
waiting (torch reads 0 as "forever").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from axond.errors import DistributedError, StoreError, StoreTimeout
from axond.store.base import Store, added, check_delta, check_key, check_keys, check_timeout, check_value


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


class AxondStoreOverTorch(Store):
    """An axond `Store` over a torch store object (TCPStore, FileStore, PrefixStore, ...; torch is not imported here):
    what a backend creator is given becomes an axond group's rendezvous. Keys get `prefix` in front."""

    def __init__(self, store: Any, prefix: str = "", where: str = "torch store") -> None:
        self.torch_store = store
        self.prefix = prefix
        self.where = where

    def _k(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except (StoreError, ValueError, TypeError):
            raise
        except Exception as e:  # torch's DistStoreError, DistNetworkError, RuntimeError
            if _timeout_error(e):
                raise StoreTimeout(f"{self.where}: {what} timed out: {e}") from e
            raise StoreError(f"{self.where}: {what} failed ({e}); the process serving it may have exited") from e

    def _current(self, k: str) -> bytes | None:
        if not self._call("check", self.torch_store.check, [k]):
            return None
        return bytes(self._call("get", self.torch_store.get, k))

    def set(self, key: str, value: bytes) -> None:
        raw = check_value(check_key(key), value)
        k = self._k(key)
        self._call("set", self.torch_store.set, k, raw)
        self._call("check", self.torch_store.check, [k])  # torch's set returns unanswered; this answer follows it

    def get(self, key: str, timeout: float) -> bytes:
        self.wait([key], timeout)
        return bytes(self._call("get", self.torch_store.get, self._k(key)))

    def try_get(self, key: str) -> bytes | None:
        return self._current(self._k(key))

    def add(self, key: str, delta: int) -> int:
        k, step = self._k(key), check_delta(key, delta)
        added(key, self._current(k), step)  # torch's server would drop the connection over a non-integer
        return int(self._call("add", self.torch_store.add, k, step))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        k = self._k(key)
        want = None if expected is None else check_value(key, expected)
        raw = check_value(key, desired)
        current = self._current(k)
        if current != want:  # torch would take an unset key for b"", and answer `expected` for an unset key
            return False, current
        now = bytes(self._call("compare_set", self.torch_store.compare_set, k, want or b"", raw))
        return now == raw, now

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", self.torch_store.delete_key, self._k(key)))

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        names = [self.prefix + k for k in check_keys(keys)]
        seconds = check_timeout(timeout)
        if not names:
            return
        if seconds < 0.001:  # torch reads a zero timeout as "no timeout"
            missing = [k for k in names if not self._call("check", self.torch_store.check, [k])]
            if missing:
                raise StoreTimeout(f"{self.where}: store keys {missing[:4]} are not set (waited 0 s)")
            return
        self._call(f"wait for {names[:4]}", self.torch_store.wait, names, timedelta(seconds=seconds))


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
