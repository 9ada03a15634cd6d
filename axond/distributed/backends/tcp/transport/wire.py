"""The frame header every data-plane message carries; its op, dtype and reduce codes are `axond.distributed.ops`.

A frame is a 32-byte header followed by `payload` bytes. The header names the operation, dtype,
element count, sequence number and group, so that a peer calling a different collective, dtype
or size is detected on receipt instead of corrupting data or hanging.
"""

from __future__ import annotations

import struct
import zlib
from enum import IntEnum

from axond.distributed.ops import (
    DTYPE_CODE, DTYPES, OP_BY_NAME, OP_NAMES, REDUCE_CODES, REDUCE_NAMES, ROOTED, UNEVEN_ALL_TO_ALL, Op, describe,
    dtype_code, dtype_name, uneven_aux, uneven_back,
)

__all__ = [
    "DTYPES", "DTYPE_CODE", "HEADER", "HEADER_SIZE", "OP_BY_NAME", "OP_NAMES", "REDUCE_CODES", "REDUCE_NAMES", "ROOTED",
    "UNEVEN_ALL_TO_ALL", "Kind", "Op", "describe", "dtype_code", "dtype_name", "group_id", "uneven_aux", "uneven_back",
]
"""The frame's own fields, and the shared codes (`axond.distributed.ops`) that its header carries."""

HEADER = struct.Struct("<BBBBIIiqq")
"""kind, op, dtype, reduce op, sequence, group id, aux (root/tag), element count, payload bytes."""
HEADER_SIZE = HEADER.size


class Kind(IntEnum):
    """What a frame is."""

    COLLECTIVE = 1
    P2P = 2
    ABORT = 3


def group_id(name: str) -> int:
    """A 32-bit id of a group name, carried in every frame."""
    return zlib.crc32(name.encode())
