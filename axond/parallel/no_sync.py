"""`NoSync`: the `no_sync()` context the data-parallel wrappers (DDP, FSDP) share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class NoSync:
    """Mixed into a wrapper whose backward reduces gradients only while `_sync_enabled` is true."""

    _sync_enabled: bool = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside keep their gradients local (no communication); the first backward after it reduces the sum."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous
