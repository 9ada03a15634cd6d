"""A `Store` in a shared directory: lets processes on one host form a group without a coordinator.

Like torch's FileStore, for tests and single-host runs: each key is a file written atomically
(write to a temp name, then rename); every write holds an fcntl lock on the directory. A key's file is
`k.` and the key quoted (`h.` and its SHA-256 when that name would be long), so that no key names the
directory, its parent or the store's own files.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import time
from collections.abc import Sequence
from urllib.parse import quote

from axond.errors import StoreError, StoreTimeout
from axond.store.base import Store, added, check_delta, check_key, check_keys, check_timeout, check_value

POLL = 0.002
"""Seconds between looks for a key a wait is missing."""
MAX_NAME = 200
"""Longest quoted file name; longer keys are named by their hash (file systems allow 255 bytes)."""


class FileStore(Store):
    """Keys are files under `path` (created if missing); safe across processes on one host."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)
        self._lock_path = os.path.join(path, ".lock")

    def _file(self, key: str) -> str:
        name = "k." + quote(check_key(key), safe="")
        if len(name) > MAX_NAME:
            name = "h." + hashlib.sha256(key.encode()).hexdigest()
        return os.path.join(self.path, name)

    def _write(self, key: str, value: bytes) -> None:
        """Replace `key`'s file (the caller holds the lock)."""
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
        raw = check_value(check_key(key), value)
        fd = self._locked()
        try:
            self._write(key, raw)
        finally:
            self._unlock(fd)

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
        step = check_delta(check_key(key), delta)
        fd = self._locked()
        try:
            value = added(key, self.try_get(key), step)
            self._write(key, str(value).encode())
            return value
        finally:
            self._unlock(fd)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        want = None if expected is None else check_value(check_key(key), expected)
        raw = check_value(check_key(key), desired)
        fd = self._locked()
        try:
            current = self.try_get(key)
            if current != want:
                return False, current
            self._write(key, raw)
            return True, raw
        finally:
            self._unlock(fd)

    def delete(self, key: str) -> bool:
        path = self._file(key)
        fd = self._locked()
        try:
            os.remove(path)
            return True
        except FileNotFoundError:
            return False
        finally:
            self._unlock(fd)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        paths = [(key, self._file(key)) for key in check_keys(keys)]
        seconds = check_timeout(timeout)
        deadline = time.monotonic() + seconds
        for key, path in paths:
            while not os.path.exists(path):
                if time.monotonic() >= deadline:
                    missing = [k for k, p in paths if not os.path.exists(p)]
                    raise StoreTimeout(f"timed out after {seconds:.1f}s waiting for store keys {missing[:4]}")
                time.sleep(POLL)
