"""A `Store` in a shared directory: lets processes on one host form a group without a coordinator.

Like torch's FileStore, for tests and single-host runs: each key is a file written atomically
(write to a temp name, then rename); `add` and `compare_set` hold an fcntl lock on the directory.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Sequence
from urllib.parse import quote

from axond.errors import StoreError, StoreTimeout
from axond.store.base import MAX_VALUE_BYTES, Store

POLL = 0.002


class FileStore(Store):
    """Keys are files under `path` (created if missing); safe across processes on one host."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)
        self._lock_path = os.path.join(path, ".lock")

    def _file(self, key: str) -> str:
        if not key:
            raise StoreError("store key must be a non-empty string")
        return os.path.join(self.path, quote(key, safe=""))

    def _write(self, key: str, value: bytes) -> None:
        if len(value) > MAX_VALUE_BYTES:
            raise StoreError(f"store value for {key!r} is {len(value)} bytes; the limit is {MAX_VALUE_BYTES}")
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, self._file(key))

    def _locked(self) -> int:
        fd = os.open(self._lock_path, os.O_CREAT | os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _unlock(self, fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def set(self, key: str, value: bytes) -> None:
        self._write(key, bytes(value))

    def try_get(self, key: str) -> bytes | None:
        try:
            with open(self._file(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def get(self, key: str, timeout: float) -> bytes:
        self.wait([key], timeout)
        value = self.try_get(key)
        if value is None:
            raise StoreError(f"store key {key!r} was deleted while being read")
        return value

    def add(self, key: str, delta: int) -> int:
        fd = self._locked()
        try:
            raw = self.try_get(key) or b"0"
            try:
                value = int(raw) + delta
            except ValueError as e:
                raise StoreError(f"store key {key!r} holds {raw!r}, not an integer") from e
            self._write(key, str(value).encode())
            return value
        finally:
            self._unlock(fd)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        fd = self._locked()
        try:
            current = self.try_get(key)
            if current != expected:
                return False, current
            self._write(key, bytes(desired))
            return True, bytes(desired)
        finally:
            self._unlock(fd)

    def delete(self, key: str) -> bool:
        try:
            os.remove(self._file(key))
            return True
        except FileNotFoundError:
            return False

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for key in keys:
            path = self._file(key)
            while not os.path.exists(path):
                if time.monotonic() >= deadline:
                    raise StoreTimeout(f"timed out after {timeout:.1f}s waiting for store key {key!r}")
                time.sleep(POLL)
