"""`InMemoryStore`: a `Store` living in one process, for groups of threads (tests, benchmarks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from axond.errors import StoreTimeout
from axond.store.base import Store, added, check_delta, check_key, check_keys, check_timeout, check_value


class InMemoryStore(Store):
    """A thread-safe store living in this process: for groups of threads (tests, benchmarks)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        raw = check_value(check_key(key), value)
        with self._cond:
            self._data[key] = raw
            self._cond.notify_all()

    def get(self, key: str, timeout: float) -> bytes:
        self.wait([key], timeout)
        with self._cond:
            return self._data[key]

    def try_get(self, key: str) -> bytes | None:
        check_key(key)
        with self._cond:
            return self._data.get(key)

    def add(self, key: str, delta: int) -> int:
        step = check_delta(check_key(key), delta)
        with self._cond:
            value = added(key, self._data.get(key), step)
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        want = None if expected is None else check_value(check_key(key), expected)
        raw = check_value(check_key(key), desired)
        with self._cond:
            current = self._data.get(key)
            if current != want:
                return False, current
            self._data[key] = raw
            self._cond.notify_all()
            return True, raw

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._cond:
            return self._data.pop(key, None) is not None

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        names = check_keys(keys)
        seconds = check_timeout(timeout)
        deadline = time.monotonic() + seconds
        with self._cond:
            while True:
                missing = [k for k in names if k not in self._data]
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreTimeout(f"timed out after {seconds:.1f}s waiting for store keys {missing[:4]}")
                self._cond.wait(left)
