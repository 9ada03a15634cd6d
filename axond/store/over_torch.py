"""`AxondStoreOverTorch`: an axond `Store` over any torch store object (torch is not imported here).

Torch's stores keep a smaller contract than axond's, which the adapter makes up for: an unset key and an empty
value look alike to torch's compare_set, and its server drops the connection of an `add` to a non-integer; so
compare_set and add read the key first (one more round trip; a write racing between that read and the change
can still see torch's semantics). Torch's `set` returns before the server has it, so `set` asks one more
question on the same connection: when it returns, every client sees the value. A zero wait looks instead of
waiting (torch reads 0 as "forever").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from axond.errors import StoreError, StoreTimeout
from axond.store.base import Store, added, check_delta, check_key, check_keys, check_timeout, check_value


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
