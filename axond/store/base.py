"""The key-value store interface the data plane builds on, and `PrefixStore`.

The coordinator's per-job, per-generation KV store (`axond.store.coordinator.CoordinatorStore`) is the
real one; `InMemoryStore` (`axond.store.memory`) serves groups of threads in one process (tests, benchmarks) with
the same semantics. Keys are strings, values are opaque bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from axond.errors import StoreError

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


def check(key: str, value: bytes | None = None) -> None:
    if not key:
        raise StoreError("store key must be a non-empty string")
    if value is not None and len(value) > MAX_VALUE_BYTES:
        raise StoreError(f"store value for {key!r} is {len(value)} bytes; the limit is {MAX_VALUE_BYTES}")


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
