"""`InMemoryStore`: a `Store` living in one process, for groups of threads (tests, benchmarks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from axond.errors import StoreError, StoreTimeout
from axond.store.base import Store, check


class InMemoryStore(Store):
    """A thread-safe store living in this process: for groups of threads (tests, benchmarks)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        check(key, value)
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str, timeout: float) -> bytes:
        self.wait([key], timeout)
        with self._cond:
            return self._data[key]

    def try_get(self, key: str) -> bytes | None:
        check(key)
        with self._cond:
            return self._data.get(key)

    def add(self, key: str, delta: int) -> int:
        check(key)
        with self._cond:
            raw = self._data.get(key, b"0")
            try:
                value = int(raw) + delta
            except ValueError as e:
                raise StoreError(f"store key {key!r} holds {raw!r}, not an integer") from e
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        check(key, desired)
        with self._cond:
            current = self._data.get(key)
            if current != expected:
                return False, current
            self._data[key] = bytes(desired)
            self._cond.notify_all()
            return True, self._data[key]

    def delete(self, key: str) -> bool:
        check(key)
        with self._cond:
            return self._data.pop(key, None) is not None

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        for key in keys:
            check(key)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreTimeout(f"timed out after {timeout:.1f}s waiting for store keys {missing[:4]}")
                self._cond.wait(left)
