"""One job generation's key-value space and its named barriers (plain; the caller holds the lock)."""

from __future__ import annotations

from dataclasses import dataclass, field

from axond.coordinator.errors import (
    MAX_KEY_CHARS,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    check_name,
)
from axond.store import MAX_VALUE_BYTES

MAX_SPACE_BYTES = 256 << 20
"""Total bytes of keys and values one job generation may hold."""


def check_key(key: str) -> str:
    if not key:
        raise InvalidArgument("store key must be a non-empty string")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidArgument(f"store key of {len(key)} characters; the limit is {MAX_KEY_CHARS}")
    return key


def check_value(key: str, value: bytes) -> bytes:
    if len(value) > MAX_VALUE_BYTES:
        raise InvalidArgument(
            f"store value for {key!r} is {len(value)} bytes; the limit is {MAX_VALUE_BYTES} "
            "(the store carries addresses and IDs, send tensors over the data plane)"
        )
    return value


@dataclass
class BarrierState:
    """Arrivals at one named barrier."""

    world_size: int
    arrivals: set[str] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return len(self.arrivals) >= self.world_size


class KvSpace:
    """Keys and barriers of one (job, generation)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.barriers: dict[str, BarrierState] = {}
        self._bytes = 0

    def _put(self, key: str, value: bytes) -> None:
        old = self.data.get(key)
        grow = len(key) + len(value) - (0 if old is None else len(key) + len(old))
        if self._bytes + grow > MAX_SPACE_BYTES:
            raise ResourceExhausted(
                f"the job's store would exceed {MAX_SPACE_BYTES >> 20} MiB; delete keys that are no longer needed"
            )
        self.data[key] = value
        self._bytes += grow

    def set(self, key: str, value: bytes) -> None:
        self._put(check_key(key), check_value(key, bytes(value)))

    def get(self, key: str) -> bytes | None:
        return self.data.get(check_key(key))

    def add(self, key: str, delta: int) -> int:
        check_key(key)
        raw = self.data.get(key, b"0")
        try:
            value = int(raw) + delta
        except ValueError as e:
            raise FailedPrecondition(f"store key {key!r} holds {raw[:32]!r}, not an integer; add needs one") from e
        self._put(key, str(value).encode())
        return value

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        """Set `key` to `desired` if it holds `expected` (None: unset); returns (swapped, current)."""
        check_key(key)
        check_value(key, desired)
        current = self.data.get(key)
        if current != expected:
            return False, current
        self._put(key, bytes(desired))
        return True, self.data[key]

    def delete(self, key: str) -> bool:
        check_key(key)
        old = self.data.pop(key, None)
        if old is None:
            return False
        self._bytes -= len(key) + len(old)
        return True

    def missing(self, keys: list[str]) -> list[str]:
        return [k for k in keys if k not in self.data]

    def arrive(self, name: str, world_size: int, arrival: str) -> BarrierState:
        """Record one arrival at barrier `name` (idempotent per arrival id)."""
        check_name("barrier name", name)
        if world_size < 1:
            raise InvalidArgument(f"barrier {name!r}: world_size is {world_size}; it must be >= 1")
        barrier = self.barriers.get(name)
        if barrier is None:
            barrier = self.barriers[name] = BarrierState(world_size)
        elif barrier.world_size != world_size:
            raise InvalidArgument(
                f"barrier {name!r} was entered with world_size {barrier.world_size}, now {world_size}; "
                "every participant must pass the same size"
            )
        if arrival not in barrier.arrivals and barrier.done:
            raise FailedPrecondition(
                f"barrier {name!r} already has its {world_size} arrivals; barrier names are single-use, "
                "put a sequence number into the name"
            )
        barrier.arrivals.add(arrival)
        return barrier

    def barrier(self, name: str) -> BarrierState:
        barrier = self.barriers.get(name)
        if barrier is None:
            raise NotFound(f"barrier {name!r} does not exist")
        return barrier
