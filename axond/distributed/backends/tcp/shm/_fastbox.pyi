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

class Box:
    ops: int
    turns: int
    home: int
    moves: int
    blocks: int
    long_yields: int
    quiet_until: int
    crowds: int
    def __init__(self, mapping: Any, turns: int, poll_ns: int = 0, block_ns: int = 0,
                 long_yield_ns: int = 1_000_000_000, calm_ops: int = 0, slot: int = 0, size: int = 0,
                 rank: int = -1) -> None: ...
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
