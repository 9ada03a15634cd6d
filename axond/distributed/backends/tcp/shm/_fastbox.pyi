"""The prepared mailbox ops in C (`_fastbox.c`; see `mailbox_ops.Prepared`)."""

from collections.abc import Sequence
from typing import Any

ALL_REDUCE: int
BROADCAST_ROOT: int
BROADCAST_LEAF: int
ALL_GATHER: int
REDUCE_SCATTER: int
BARRIER: int
SUM: int
PRODUCT: int
MIN: int
MAX: int
FLOAT32: int
FLOAT64: int
INT32: int
INT64: int
NO_DTYPE: int
MAX_SIZE: int
HEAD_BYTES: int
PAYLOAD_OFFSET: int
LAYOUT: dict[str, int]

class Box:
    ops: int
    turns: int
    home: int
    moves: int
    blocks: int
    yield_cost: int
    yielding: int
    probes: int
    def __init__(self, mapping: Any, turns: int, poll_ns: int = 0, block_ns: int = 0,
                 yield_limit_ns: int = 200_000, probe_ops: int = 1024, slot: int = 0, size: int = 0,
                 rank: int = -1, probe_first: int = 16, home_every: int = 64, move_every: int = 16) -> None: ...
    def wait(self, slots: Sequence[int], k: int, seconds: float) -> bool: ...
    def publish(self, slot: int, k: int) -> None: ...
    def close(self) -> None: ...
    def go_home(self) -> bool: ...

class Op:
    box: Box
    def __init__(self, box: Box, kind: int, rank: int, size: int, slots: Sequence[int], header: bytes, posted: int,
                 nbytes: int, root: int, dtype: int, redop: int, average: bool, count: int, part: int,
                 out_bytes: int) -> None: ...
    def run(self, seq: int, a: Any = None, b: Any = None) -> int | None: ...
    def finish(self, buf: int, a: Any = None, b: Any = None) -> None: ...
