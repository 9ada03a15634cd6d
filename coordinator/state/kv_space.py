"""One job generation's key-value space and its named barriers (plain; the caller holds the lock)."""

from __future__ import annotations

from dataclasses import dataclass, field

from axond.coordinator.state.errors import (
    MAX_KEY_CHARS,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    check_name,
    short,
)
from axond.coordinator.limits import CoordinatorLimits
from axond.store import MAX_VALUE_BYTES

MAX_SPACE_BYTES = CoordinatorLimits.max_store_bytes_per_job
"""Total bytes of keys, values and barrier arrivals one job generation may hold by default."""

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
ARRIVAL_OVERHEAD = 64
"""Bytes charged per barrier (and per arrival) on top of its name or id."""


CARRIED_PREFIX = "axond/job/"
"""Keys under it outlive a restart: the next generation's space starts with them (what one generation tells the
next, such as the step of the last checkpoint the job saved); every other key is the generation's own."""

ANSWERED_PREFIX = "\x00answered:"
"""Where a space keeps the answers of requests that carried a request id (a retry gets the first answer): keys
like any other, so they are charged, committed and restored with the store. User keys cannot start with NUL."""
MAX_ANSWERED = 1024
"""Answers kept per (job, generation); the oldest go first."""
MAX_REQUEST_ID_CHARS = 64


def check_key(key: str, limit: int = MAX_KEY_CHARS) -> str:
    if not key:
        raise InvalidArgument("store key must be a non-empty string")
    if key[0] == "\x00":
        raise InvalidArgument("store keys cannot start with a NUL character (reserved for the coordinator)")
    if len(key) > limit:
        raise InvalidArgument(f"store key of {len(key)} characters; the limit is {limit}")
    return key


def check_value(key: str, value: bytes) -> bytes:
    if len(value) > MAX_VALUE_BYTES:
        raise InvalidArgument(
            f"store value for {short(key)} is {len(value)} bytes; the limit is {MAX_VALUE_BYTES} "
            "(the store carries addresses and IDs, send tensors over the data plane)"
        )
    return value


class ByteBudget:
    """Bytes held by every KV space together, against `max_store_bytes`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0


@dataclass
class BarrierState:
    """Arrivals at one named barrier."""

    world_size: int
    arrivals: set[str] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return len(self.arrivals) >= self.world_size


class KvSpace:
    """Keys and barriers of one (job, generation), charged to the coordinator's byte budget."""

    def __init__(self, limits: CoordinatorLimits | None = None, budget: ByteBudget | None = None) -> None:
        self.limits = limits or CoordinatorLimits()
        self.budget = budget or ByteBudget(self.limits.max_store_bytes)
        self.data: dict[str, bytes] = {}
        self.barriers: dict[str, BarrierState] = {}
        self._bytes = 0
        self._answered: list[str] | None = None
        """Keys of the kept answers, oldest first (built from `data` on first use: a restored space has them)."""

    def _charge(self, grow: int, check: bool = True) -> None:
        """Account `grow` more bytes (negative: fewer), refusing growth past either limit (unless not `check`)."""
        if grow > 0 and check:
            if self._bytes + grow > self.limits.max_store_bytes_per_job:
                raise ResourceExhausted(
                    f"the job's store would exceed {self.limits.max_store_bytes_per_job} bytes "
                    "(max_store_bytes_per_job); delete keys that are no longer needed"
                )
            if self.budget.used + grow > self.budget.limit:
                raise ResourceExhausted(
                    f"the coordinator's stores would exceed {self.budget.limit} bytes (max_store_bytes); "
                    "finished jobs free theirs, or raise the limit"
                )
        self._bytes += grow
        self.budget.used += grow

    def answer_of(self, request_id: str) -> bytes | None:
        """The answer kept for `request_id` (validated), or None if it was not answered (or was forgotten)."""
        if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
        return self.data.get(ANSWERED_PREFIX + request_id)

    def keep_answer(self, request_id: str, answer: bytes) -> list[str]:
        """Keep `answer` for `request_id`; the keys changed (it, and the oldest answers dropped past MAX_ANSWERED)."""
        if self._answered is None:
            self._answered = [k for k in self.data if k.startswith(ANSWERED_PREFIX)]
        key = ANSWERED_PREFIX + request_id
        # Never refused for space: the change it answers is made already. Bounded by MAX_ANSWERED instead.
        self._charge(len(key) + len(answer), check=False)
        self.data[key] = answer
        self._answered.append(key)
        changed = [key]
        while len(self._answered) > MAX_ANSWERED:
            old = self._answered.pop(0)
            value = self.data.pop(old, None)
            if value is not None:
                self._charge(-(len(old) + len(value)))
                changed.append(old)
        return changed

    def release(self) -> None:
        """Give this space's bytes back to the budget (the generation or job is gone)."""
        self.budget.used -= self._bytes
        self._bytes = 0
        self.data.clear()
        self.barriers.clear()

    def _key(self, key: str) -> str:
        return check_key(key, self.limits.max_key_chars)

    def _put(self, key: str, value: bytes) -> None:
        old = self.data.get(key)
        self._charge(len(key) + len(value) - (0 if old is None else len(key) + len(old)))
        self.data[key] = value

    def restore(self, key: str, value: bytes) -> None:
        """Put back a committed key (at start): charged, never refused, as it was accepted once."""
        self._charge(len(key) + len(value), check=False)
        self.data[key] = value

    def carried(self) -> list[tuple[str, bytes]]:
        """The keys the next generation starts with (CARRIED_PREFIX)."""
        return [(k, v) for k, v in self.data.items() if k.startswith(CARRIED_PREFIX)]

    def set(self, key: str, value: bytes) -> None:
        self._put(self._key(key), check_value(key, bytes(value)))

    def get(self, key: str) -> bytes | None:
        return self.data.get(self._key(key))

    def add(self, key: str, delta: int) -> int:
        self._key(key)
        raw = self.data.get(key, b"0")
        try:
            value = int(raw) + delta
        except ValueError as e:
            raise FailedPrecondition(f"store key {short(key)} holds {raw[:32]!r}, not an integer; add needs one") from e
        if not INT64_MIN <= value <= INT64_MAX:
            raise OutOfRange(
                f"adding {delta} to store key {short(key)} ({int(raw)}) leaves the 64-bit range; the value is unchanged"
            )
        self._put(key, str(value).encode())
        return value

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        """Set `key` to `desired` if it holds `expected` (None: unset); returns (swapped, current)."""
        self._key(key)
        check_value(key, desired)
        current = self.data.get(key)
        if current != expected:
            return False, current
        self._put(key, bytes(desired))
        return True, self.data[key]

    def delete(self, key: str) -> bool:
        self._key(key)
        old = self.data.pop(key, None)
        if old is None:
            return False
        self._charge(-(len(key) + len(old)))
        return True

    def missing(self, keys: list[str]) -> list[str]:
        if len(keys) > self.limits.max_wait_keys:
            raise InvalidArgument(f"a wait for {len(keys)} keys; the limit is {self.limits.max_wait_keys} (max_wait_keys)")
        for key in keys:
            self._key(key)
        return [k for k in keys if k not in self.data]

    def arrive(self, name: str, world_size: int, arrival: str) -> BarrierState:
        """Record one arrival at barrier `name` (idempotent per arrival id); arrivals count against the budget."""
        check_name("barrier name", name, self.limits.max_name_chars)
        if world_size < 1 or world_size > self.limits.max_world_size:
            raise InvalidArgument(
                f"barrier {short(name)}: world_size is {world_size}; it must be in 1..{self.limits.max_world_size}"
            )
        if len(arrival) > self.limits.max_key_chars + 16:
            raise InvalidArgument(f"barrier arrival id of {len(arrival)} characters; the limit is {self.limits.max_key_chars}")
        barrier = self.barriers.get(name)
        if barrier is None:
            self._charge(len(name) + ARRIVAL_OVERHEAD)
            barrier = self.barriers[name] = BarrierState(world_size)
        elif barrier.world_size != world_size:
            raise InvalidArgument(
                f"barrier {short(name)} was entered with world_size {barrier.world_size}, now {world_size}; "
                "every participant must pass the same size"
            )
        if arrival not in barrier.arrivals:
            if barrier.done:
                raise FailedPrecondition(
                    f"barrier {short(name)} already has its {world_size} arrivals; barrier names are single-use, "
                    "put a sequence number into the name"
                )
            self._charge(len(arrival) + ARRIVAL_OVERHEAD)
            barrier.arrivals.add(arrival)
        return barrier

    def barrier(self, name: str) -> BarrierState:
        barrier = self.barriers.get(name)
        if barrier is None:
            raise NotFound(f"barrier {short(name)} does not exist")
        return barrier
