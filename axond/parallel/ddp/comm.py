"""The collectives DDP needs beyond the bucket all-reduce: coalesced broadcast and the default group.

Forward: `broadcast_coalesced` copies rank 0's parameters/buffers into every rank's arrays, one
flat message per dtype. Backward: nothing (gradient averaging lives in `buckets.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from axond.nn.device import Array, array_module, device_of, empty_on
from axond.distributed import default_registry as defaults


def broadcast_coalesced(arrays: Sequence[Array], group: Any, src: int = 0, cap_bytes: int = 64 << 20) -> None:
    """Broadcast `arrays` in place from group rank `src`, packed into flat messages of one dtype and device."""
    groups: dict[tuple[str, str], list[Array]] = {}
    for a in arrays:
        groups.setdefault((str(a.dtype), str(device_of(a))), []).append(a)
    for members in groups.values():
        xp = array_module(members[0])
        chunk: list[Array] = []
        size = 0
        for a in members + [None]:
            if a is not None and (not chunk or (size + a.nbytes) <= cap_bytes):
                chunk.append(a)
                size += a.nbytes
                continue
            if len(chunk) > 1:
                flat = empty_on(chunk[0], size // chunk[0].itemsize, chunk[0].dtype)
                offset = 0
                for c in chunk:
                    flat[offset : offset + c.size] = c.reshape(-1)
                    offset += c.size
            else:
                flat = xp.ascontiguousarray(chunk[0]).reshape(-1)
            group.broadcast(flat, src=src)
            offset = 0
            for c in chunk:
                c[...] = flat[offset : offset + c.size].reshape(c.shape)
                offset += c.size
            chunk, size = ([a], a.nbytes) if a is not None else ([], 0)


def default_group() -> Any:
    """axond's default process group (set by `axond.init_process_group`), or a clear error."""
    return defaults.require("DistributedDataParallel")
