"""The key-value store interface the data plane builds on, and an in-process implementation.

The coordinator's per-job, per-generation KV store (`axond.control.coordinator_store.CoordinatorStore`) is the
real one; `InMemoryStore` serves groups of threads in one process (tests, benchmarks) with the
same semantics. Keys are strings, values are opaque bytes.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

from axond.errors import StoreError, StoreTimeout

MAX_VALUE_BYTES = 1 << 20
"""Largest value a store accepts (1 MiB): the store carries addresses and IDs, not tensors."""


class Store(ABC):
    """A key-value store shared by the members of one job generation."""

    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Set `key` to `value`, waking anyone waiting for it."""

    @abstractmethod
    def get(self, key: str, timeout: float) -> bytes:
        """Return the value of `key`, waiting up to `timeout` seconds for it to be set."""

    @abstractmethod
    def try_get(self, key: str) -> bytes | None:
        """Return the value of `key`, or None if it is not set; never waits."""

    @abstractmethod
    def add(self, key: str, delta: int) -> int:
        """Atomically add `delta` to the integer at `key` (0 if unset) and return the new value."""

    @abstractmethod
    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        """Set `key` to `desired` if its value is `expected` (None: unset). Returns (swapped, current)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Delete `key`; returns whether it existed."""

    @abstractmethod
    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Wait until every key in `keys` is set; raises `StoreTimeout` after `timeout` seconds."""

    def barrier(self, name: str, world_size: int, timeout: float) -> None:
        """Block until `world_size` participants called `barrier(name, ...)`.

        Built on `add` and `wait`, so every store has it; a store may override it with a native one.
        A name is single-use: callers put a sequence number into it.
        """
        arrived = self.add(f"__barrier/{name}/count", 1)
        if arrived == world_size:
            self.set(f"__barrier/{name}/done", b"1")
        elif arrived > world_size:
            raise StoreError(f"barrier {name!r}: {arrived} arrivals for world size {world_size}")
        self.wait([f"__barrier/{name}/done"], timeout)

    def close(self) -> None:
        """Release connections; the default has none."""


def _check(key: str, value: bytes | None = None) -> None:
    if not key:
        raise StoreError("store key must be a non-empty string")
    if value is not None and len(value) > MAX_VALUE_BYTES:
        raise StoreError(f"store value for {key!r} is {len(value)} bytes; the limit is {MAX_VALUE_BYTES}")


class InMemoryStore(Store):
    """A thread-safe store living in this process: for groups of threads (tests, benchmarks)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        _check(key, value)
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str, timeout: float) -> bytes:
        self.wait([key], timeout)
        with self._cond:
            return self._data[key]

    def try_get(self, key: str) -> bytes | None:
        _check(key)
        with self._cond:
            return self._data.get(key)

    def add(self, key: str, delta: int) -> int:
        _check(key)
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
        _check(key, desired)
        with self._cond:
            current = self._data.get(key)
            if current != expected:
                return False, current
            self._data[key] = bytes(desired)
            self._cond.notify_all()
            return True, self._data[key]

    def delete(self, key: str) -> bool:
        _check(key)
        with self._cond:
            return self._data.pop(key, None) is not None

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        for key in keys:
            _check(key)
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


class PrefixStore(Store):
    """A view of another store with every key under `prefix/` (one namespace per group)."""

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix = prefix
        self.base = store

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: bytes) -> None:
        self.base.set(self._k(key), value)

    def get(self, key: str, timeout: float) -> bytes:
        return self.base.get(self._k(key), timeout)

    def try_get(self, key: str) -> bytes | None:
        return self.base.try_get(self._k(key))

    def add(self, key: str, delta: int) -> int:
        return self.base.add(self._k(key), delta)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        return self.base.compare_set(self._k(key), expected, desired)

    def delete(self, key: str) -> bool:
        return self.base.delete(self._k(key))

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        self.base.wait([self._k(k) for k in keys], timeout)

    def barrier(self, name: str, world_size: int, timeout: float) -> None:
        self.base.barrier(self._k(name), world_size, timeout)
