"""`TorchStore`: axond's KV store as a `torch.distributed.Store`.

`TorchStore` lets torch (rendezvous, new_group, DeviceMesh, elastic agents) keep its keys in the
coordinator's per-job KV store. The other way, a torch store as an axond `Store`, needs no torch import and
lives with the stores: `axond.store.over_torch.AxondStoreOverTorch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from axond.errors import StoreError
from axond.store.base import Store


def _bytes(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(timeout: timedelta | None, default: timedelta) -> float:
    return (timeout if timeout is not None else default).total_seconds()


class TorchStore(dist.Store):
    """A `torch.distributed.Store` over an axond `Store` (e.g. the coordinator's KV of one job generation).

    Waits are bounded by the store's timeout (`set_timeout`, default 300 s) and raise `StoreTimeout`
    (a `TimeoutError`). `num_keys` is not available: axond's stores do not count keys.
    """

    def __init__(self, store: Store, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self.axond_store = store
        self.set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self.axond_store.set(key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self.axond_store.get(key, self.timeout.total_seconds())

    def add(self, key: str, value: int) -> int:
        return self.axond_store.add(key, int(value))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """torch's semantics: an empty `expected_value` matches an unset key; returns the value now held."""
        expected = _bytes(expected_value)
        swapped, current = self.axond_store.compare_set(key, expected if expected or self.check([key]) else None,
                                                        _bytes(desired_value))
        if current is None:
            return expected
        return current

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self.axond_store.wait(list(keys), _seconds(timeout, self.timeout))

    def check(self, keys: Sequence[str]) -> bool:
        return all(self.axond_store.try_get(k) is not None for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.axond_store.delete(key)

    def num_keys(self) -> int:
        raise StoreError("num_keys is not available on axond's stores (they do not count keys); "
                         "track the keys you need with add()")
