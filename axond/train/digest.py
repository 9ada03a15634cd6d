"""Replicas that agree: a digest of the parameters, compared across the replicas of a data-parallel group.

Under DDP (and ZeRO-1, whose step all-gathers the updated shards) every rank holds the same parameters bit for bit
after each optimizer step. A silent fault (a flipped bit in memory, a bad core) makes one replica differ, and the
all-reduce then spreads gradients computed from the wrong weights without any error. `replica_digest` hashes the raw
bytes of every parameter (zlib's CRC-32 and Adler-32, C loops over the buffers, no copies for contiguous arrays) into
one uint64; `check_replicas` all-gathers one uint64 per rank and names the ranks whose digest differs from the
majority's (with no strict majority, every rank: there is no telling which side is right).
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

from axond.distributed.process_group import ProcessGroup


def _raw(p: Any) -> np.ndarray:
    data = getattr(p, "data", p)
    return data if isinstance(data, np.ndarray) and data.flags.c_contiguous else np.ascontiguousarray(data)


def replica_digest(params: Iterable[Any]) -> int:
    """The digest of `params` (arrays or `Parameter`s, in order) as an unsigned 64-bit integer: CRC-32 of all their
    bytes in the high half, Adler-32 in the low half. Equal parameters give equal digests; one flipped bit anywhere
    changes the CRC."""
    crc, adler = 0, 1
    for p in params:
        raw = memoryview(_raw(p)).cast("B")
        crc = zlib.crc32(raw, crc)
        adler = zlib.adler32(raw, adler)
    return (crc << 32) | adler


def disagreeing(digests: Iterable[int]) -> list[int]:
    """The positions whose digest differs from the strict majority's; all of them where no digest has a majority
    (two ranks that differ: both named), none when all agree."""
    values = [int(d) for d in digests]
    if len(set(values)) <= 1:
        return []
    common, count = Counter(values).most_common(1)[0]
    if 2 * count <= len(values):
        return list(range(len(values)))
    return [r for r, d in enumerate(values) if d != common]


def check_replicas(params: Iterable[Any], group: ProcessGroup) -> list[int]:
    """Collective over `group`: the group ranks whose parameters differ from the majority's (see `disagreeing`);
    [] when every replica agrees. Sends one uint64 per rank."""
    mine = np.array([replica_digest(params)], dtype=np.uint64)
    gathered = group.all_gather(mine)
    return disagreeing(np.asarray(gathered).reshape(-1).tolist())
