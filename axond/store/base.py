"""The key-value store interface the data plane builds on, the argument checks every store shares, and `PrefixStore`.

Keys are strings, values are opaque bytes. Every store (`axond.store.memory`, `file`, `tcp`, `coordinator`,
`torch_agent`, `over_torch`) keeps the same contract, checked by one suite run on each
(tests/init/test_store_contract.py): the same argument checks (this module's `check_*`), the same results,
`StoreTimeout` naming the keys when a wait runs out.
"""

from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence

from axond.errors import StoreError

MAX_VALUE_BYTES = 1 << 20
"""Largest value a store accepts (1 MiB): the store carries addresses and IDs, not tensors."""
MAX_KEY_CHARS = 1024
"""Longest key (characters): the coordinator's limit, kept by every store so that a program moves between them."""
MAX_WAIT_KEYS = 1024
"""Most keys one `wait` may name."""
MAX_TIMEOUT = 7 * 86400.0
"""Longest wait (seconds, a week): a bound that catches a unit mistake; loop for longer."""
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def check_key(key: str) -> str:
    """`key` if it is a valid store key: a non-empty str of at most MAX_KEY_CHARS characters, not starting with
    NUL (reserved for the coordinator's own records). TypeError for a non-str, else StoreError."""
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__} {key!r:.60}")
    if not key:
        raise StoreError("store key must be a non-empty string")
    if key[0] == "\x00":
        raise StoreError(f"store key {key[:40]!r}: keys cannot start with a NUL character (reserved)")
    if len(key) > MAX_KEY_CHARS:
        raise StoreError(f"store key {key[:40]!r}... is {len(key)} characters; the limit is {MAX_KEY_CHARS}")
    try:
        key.encode()
    except UnicodeEncodeError as e:
        raise StoreError(f"store key {key[:40]!r} is not valid Unicode text ({e.reason})") from e
    return key


def check_value(key: str, value: bytes) -> bytes:
    """`value` as bytes if it is bytes-like and at most MAX_VALUE_BYTES long. TypeError for another type (a str:
    encode it first), else StoreError."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"store value for {key[:60]!r} must be bytes, got {type(value).__name__}"
                        f"{' (encode text first: value.encode())' if isinstance(value, str) else ''}")
    raw = bytes(value)
    if len(raw) > MAX_VALUE_BYTES:
        raise StoreError(f"store value for {key[:60]!r} is {len(raw)} bytes; the limit is {MAX_VALUE_BYTES} "
                         "(the store carries addresses and IDs, send tensors over the data plane)")
    return raw


def check_keys(keys: Sequence[str]) -> list[str]:
    """`keys` (a list or tuple of valid keys, at most MAX_WAIT_KEYS of them) as a list."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(f"store wait takes a list of keys, got {type(keys).__name__} {keys!r:.60}")
    if len(keys) > MAX_WAIT_KEYS:
        raise StoreError(f"a store wait may name {MAX_WAIT_KEYS} keys at most, got {len(keys)}")
    return [check_key(k) for k in keys]


def check_timeout(timeout: float) -> float:
    """`timeout` as float seconds if it is a number in 0..MAX_TIMEOUT, else StoreError (TypeError: not a number)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"store timeout must be seconds (a number), got {type(timeout).__name__} {timeout!r:.60}")
    if math.isnan(timeout) or not 0 <= timeout <= MAX_TIMEOUT:
        raise StoreError(f"store timeout is {timeout} s; it must be 0..{MAX_TIMEOUT:.0f} s (loop for longer waits)")
    return float(timeout)


def check_delta(key: str, delta: int) -> int:
    """`delta` as int if it is an integer (not a float) that fits in 64 bits."""
    try:
        value = operator.index(delta)
    except TypeError as e:
        raise TypeError(f"store add to {key[:60]!r}: delta must be an int, got {type(delta).__name__} "
                        f"{delta!r:.60}") from e
    if not INT64_MIN <= value <= INT64_MAX:
        raise StoreError(f"store add to {key[:60]!r}: delta {value} does not fit in 64 bits")
    return value


def added(key: str, raw: bytes | None, delta: int) -> int:
    """What `add(key, delta)` leaves at `key` holding `raw` (None: unset, counts as 0): StoreError naming the key if
    `raw` is not a decimal integer or the sum leaves 64 bits."""
    try:
        value = int(raw or b"0") + delta
    except ValueError as e:
        raise StoreError(f"store key {key[:60]!r} holds {(raw or b'')[:40]!r}, not an integer") from e
    if not INT64_MIN <= value <= INT64_MAX:
        raise StoreError(f"store add to {key[:60]!r}: the sum {value} does not fit in 64 bits")
    return value


class Store(ABC):
    """A key-value store shared by the members of one job generation.

    Every implementation checks its arguments alike (`check_key`, `check_value`, `check_keys`, `check_timeout`,
    `check_delta`): TypeError for a wrongly typed one, StoreError for an invalid one; a wait that runs out raises
    `StoreTimeout` (a StoreError and a TimeoutError) naming the keys.
    """

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
        check_timeout(timeout)
        if world_size < 1:
            raise StoreError(f"barrier {name!r}: world_size is {world_size}; it must be >= 1")
        arrived = self.add(f"__barrier/{name}/count", 1)
        if arrived == world_size:
            self.set(f"__barrier/{name}/done", b"1")
        elif arrived > world_size:
            raise StoreError(f"barrier {name!r}: {arrived} arrivals for world size {world_size}")
        self.wait([f"__barrier/{name}/done"], timeout)

    def close(self) -> None:
        """Release connections; the default has none."""


class PrefixStore(Store):
    """A view of another store with every key under `prefix/` (one namespace per group)."""

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix = check_key(prefix)
        self.base = store

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}"

    def set(self, key: str, value: bytes) -> None:
        self.base.set(self._k(key), check_value(key, value))

    def get(self, key: str, timeout: float) -> bytes:
        return self.base.get(self._k(key), timeout)

    def try_get(self, key: str) -> bytes | None:
        return self.base.try_get(self._k(key))

    def add(self, key: str, delta: int) -> int:
        return self.base.add(self._k(key), check_delta(key, delta))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        want = None if expected is None else check_value(key, expected)
        return self.base.compare_set(self._k(key), want, check_value(key, desired))

    def delete(self, key: str) -> bool:
        return self.base.delete(self._k(key))

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        self.base.wait([self._k(k) for k in check_keys(keys)], timeout)

    def barrier(self, name: str, world_size: int, timeout: float) -> None:
        self.base.barrier(self._k(name), world_size, timeout)
