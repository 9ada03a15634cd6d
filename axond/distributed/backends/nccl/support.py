"""The GPU-free half of the NCCL backend: unique-ID exchange, dtype/op plans, headers, device choice.

Everything here runs without CuPy, so CI tests it for real; `backend.py` combines it with CuPy calls.
NCCL names (``"NCCL_FLOAT32"``, ``"NCCL_SUM"``) are resolved to CuPy's integer constants in `backend.py`.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from axond.distributed.numerics.reduce_op import BITWISE, ReduceOp
from axond.distributed.numerics.reducers import check_reduce_op
from axond.errors import BackendUnavailable, DistributedError, StoreTimeout
from axond.store import Store

UNIQUE_ID_BYTES = 128
"""Size of an `ncclUniqueId` (NCCL_UNIQUE_ID_BYTES)."""
UNIQUE_ID_KEY = "nccl/unique_id"
"""Key of the unique ID inside the group's namespace of the job-generation store."""
NCCL_BF16_MIN_VERSION = 21000
"""First NCCL version (2.10.0) with ncclBfloat16."""
NCCL_P2P_MIN_VERSION = 2700
"""First NCCL version (2.7.0) with ncclSend/ncclRecv, needed for all_to_all, gather, scatter, send, recv."""
META_SLOTS = 32
"""int64 slots of a scatter metadata header: ndim, up to 24 dims, then the dtype name in 7 slots."""
_MAX_META_DIMS = 24
_NAME_OFFSET = 1 + _MAX_META_DIMS
P2P_HEADER_SLOTS = 4
"""int64 slots of a point-to-point header: magic, tag, nbytes, dtype code."""
_P2P_MAGIC = 0x41584F4E44503250  # "AXONDP2P"

_NATIVE_TYPES = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "bfloat16": "NCCL_BFLOAT16",
}
"""NumPy dtype name -> NCCL data type; int16/uint16 have no NCCL type."""
_COMPLEX_PARTS = {"complex64": "NCCL_FLOAT32", "complex128": "NCCL_FLOAT64"}
_NCCL_OPS = {
    ReduceOp.SUM: "NCCL_SUM",
    ReduceOp.PRODUCT: "NCCL_PROD",
    ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.MAX: "NCCL_MAX",
}
_BOOL_OPS = {ReduceOp.SUM: "NCCL_MAX", ReduceOp.MAX: "NCCL_MAX", ReduceOp.PRODUCT: "NCCL_MIN", ReduceOp.MIN: "NCCL_MIN",
             ReduceOp.BOR: "NCCL_MAX", ReduceOp.BAND: "NCCL_MIN"}
"""bool reduces as uint8 with NumPy's semantics: SUM is logical or, PRODUCT logical and."""


def unique_id_to_bytes(unique_id: bytes | Sequence[int]) -> bytes:
    """Turn `nccl.get_unique_id()` into 128 opaque bytes: CuPy >= 14 returns bytes, older CuPy a tuple
    of 128 C chars (signed or not by platform)."""
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} entries, got {len(unique_id)}")
    if isinstance(unique_id, (bytes, bytearray)):
        return bytes(unique_id)
    return (np.asarray(unique_id, dtype=np.int64) & 0xFF).astype(np.uint8).tobytes()


def unique_id_from_bytes(data: bytes, *, signed: bool) -> tuple[int, ...]:
    """Turn 128 bytes back into the tuple older CuPy's `NcclCommunicator` takes, as signed or unsigned C chars."""
    if len(data) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(data)}")
    return tuple(np.frombuffer(data, dtype=np.int8 if signed else np.uint8).tolist())


def communicator_id_forms(data: bytes) -> list[bytes | tuple[int, ...]]:
    """The forms `NcclCommunicator(ndev, commId, rank)` may want, in the order to try them.

    CuPy >= 14 takes `bytes`; CuPy 13 a tuple of C chars, signed on x86 and unsigned on ARM.
    A form of the wrong type raises TypeError (or OverflowError for the wrong signedness) before
    NCCL is called, so trying them in turn is safe.
    """
    return [bytes(data), unique_id_from_bytes(data, signed=True), unique_id_from_bytes(data, signed=False)]


def exchange_unique_id(
    store: Store,
    rank: int,
    make_id: Callable[[], bytes],
    timeout: float,
    *,
    group_name: str = "",
    key: str = UNIQUE_ID_KEY,
) -> bytes:
    """Group rank 0 calls `make_id()` and publishes the bytes under `key`; the others wait for them.

    `store` is the group's namespace of the job-generation store, so the key is scoped by job,
    generation and group. Raises `DistributedError` if rank 0 does not publish within `timeout`.
    """
    if rank == 0:
        unique_id = make_id()
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise DistributedError(
                f"nccl init: group {group_name!r} rank 0 made a {len(unique_id)}-byte unique id, "
                f"expected {UNIQUE_ID_BYTES}",
                op="nccl_init", group=group_name, rank=rank,
            )
        store.set(key, unique_id)
        return unique_id
    try:
        unique_id = store.get(key, timeout)
    except StoreTimeout as e:
        raise DistributedError(
            f"nccl init: group {group_name!r} rank {rank} waited {timeout:.1f}s for group rank 0 to publish "
            f"the NCCL unique id under {key!r}; is rank 0 alive and did it create this group with backend 'nccl'?",
            op="nccl_init", group=group_name, rank=rank, peer=0,
        ) from e
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise DistributedError(
            f"nccl init: group {group_name!r} rank {rank} read a {len(unique_id)}-byte value under {key!r}, "
            f"expected a {UNIQUE_ID_BYTES}-byte NCCL unique id; another backend may use the same group name",
            op="nccl_init", group=group_name, rank=rank, peer=0,
        )
    return unique_id


def preload_nccl_wheel() -> str | None:
    """Load libnccl.so.2 from the nvidia-nccl-cu12 wheel, if installed, so that CuPy's NCCL module links to it.

    The wheel puts the library under site-packages, off the loader's path; once loaded globally,
    the loader resolves CuPy's libnccl.so.2 dependency to it. Returns the path loaded, or None.
    """
    try:
        import nvidia.nccl as wheel
    except ImportError:
        return None
    for base in getattr(wheel, "__path__", []):
        path = os.path.join(base, "lib", "libnccl.so.2")
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                return None
            return path
    return None


def choose_device(requested: int | None, local_rank: str | None, device_count: int) -> int:
    """The CUDA device of this rank: `requested` if given, else LOCAL_RANK, else 0."""
    if requested is None:
        try:
            requested = int(local_rank) if local_rank else 0
        except ValueError as e:
            raise BackendUnavailable(f"LOCAL_RANK={local_rank!r} is not an integer; the worker sets it") from e
        source = f"LOCAL_RANK={requested}"
    else:
        source = f"BackendOptions.device={requested}"
    if not 0 <= requested < device_count:
        raise BackendUnavailable(
            f"{source} but {device_count} CUDA device(s) are visible; NCCL needs one device per rank, "
            f"so start at most {device_count} ranks per node or set CUDA_VISIBLE_DEVICES"
        )
    return requested


@dataclass(frozen=True)
class ReductionPlan:
    """How one reduction runs on NCCL: data type, element multiplier, op, and whether to divide after."""

    nccl_type: str
    """Name of the NCCL data type constant in `cupy.cuda.nccl`."""
    count_factor: int
    """NCCL elements per array element (2 for complex, as real and imaginary parts)."""
    nccl_op: str
    """Name of the NCCL reduction constant."""
    divide_by_size: bool
    """True when AVG runs as SUM and the result is divided by the group size afterwards."""


def reduction_plan(dtype: np.dtype[Any], op: ReduceOp, nccl_version: int) -> ReductionPlan:
    """Plan a reduction of `dtype` with `op` on NCCL `nccl_version`, or raise `TypeError` saying what to do.

    Semantics match the tcp backend (`axond.distributed.numerics.reducers`): AVG is SUM, then division by the
    group size; integer AVG is refused. ncclAvg is not used: NCCL pre-multiplies each input by
    1/size, which rounds differently from the tcp backend. On bool, SUM/MAX are logical or and
    PRODUCT/MIN logical and.
    """
    op = check_reduce_op(op, dtype)
    name = dtype.name
    if name == "bool" and op in _BOOL_OPS:
        return ReductionPlan("NCCL_UINT8", 1, _BOOL_OPS[op], False)
    if op in BITWISE:
        raise TypeError(f"NCCL has no bitwise reductions (ReduceOp.{op.name} on {name}); BAND and BOR work on bool "
                        "arrays, otherwise all_gather the arrays and combine them with np.bitwise_and/or/xor")
    if name in _COMPLEX_PARTS:
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise TypeError(f"NCCL reduces {name} arrays with SUM or AVG only, not {op.name}")
        return ReductionPlan(_COMPLEX_PARTS[name], 2, "NCCL_SUM", op is ReduceOp.AVG)
    if name not in _NATIVE_TYPES:
        raise TypeError(
            f"NCCL cannot reduce {name} arrays (it has no 16-bit integer type); cast to int32 or float32 first"
        )
    if name == "bfloat16" and nccl_version < NCCL_BF16_MIN_VERSION:
        raise TypeError(f"bfloat16 needs NCCL >= 2.10, this is {nccl_version}; cast to float32 first")
    if op is ReduceOp.AVG:
        return ReductionPlan(_NATIVE_TYPES[name], 1, "NCCL_SUM", True)
    return ReductionPlan(_NATIVE_TYPES[name], 1, _NCCL_OPS[op], False)


def transfer_type(dtype: np.dtype[Any], nccl_version: int) -> tuple[str, int]:
    """(NCCL type, elements per array element) for a pure data movement: native if NCCL has it, else bytes."""
    name = dtype.name
    if name in _NATIVE_TYPES and (name != "bfloat16" or nccl_version >= NCCL_BF16_MIN_VERSION):
        return _NATIVE_TYPES[name], 1
    return "NCCL_UINT8", dtype.itemsize


def dtype_from_name(name: str) -> np.dtype[Any]:
    """NumPy dtype named `name`, including ml_dtypes' bfloat16 that NumPy itself does not know."""
    try:
        return np.dtype(name)
    except TypeError:
        try:
            import ml_dtypes
        except ImportError as e:
            raise TypeError(f"dtype {name!r} needs the ml_dtypes package: pip install ml_dtypes") from e
        return np.dtype(getattr(ml_dtypes, name))


def encode_meta(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """Pack an array's shape and dtype into `META_SLOTS` int64 (what scatter sends before the data)."""
    if len(shape) > _MAX_META_DIMS:
        raise ValueError(f"scatter supports at most {_MAX_META_DIMS} dimensions per slice, got {len(shape)}")
    name = dtype.name.encode()
    if len(name) > 8 * (META_SLOTS - _NAME_OFFSET):
        raise ValueError(f"dtype name {dtype.name!r} is too long to send")
    meta = np.zeros(META_SLOTS, dtype=np.int64)
    meta[0] = len(shape)
    meta[1 : 1 + len(shape)] = shape
    raw = np.zeros(8 * (META_SLOTS - _NAME_OFFSET), dtype=np.uint8)
    raw[: len(name)] = np.frombuffer(name, dtype=np.uint8)
    meta[_NAME_OFFSET:] = raw.view(np.int64)
    return meta


def decode_meta(meta: np.ndarray) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Inverse of `encode_meta`."""
    ndim = int(meta[0])
    if not 0 <= ndim <= _MAX_META_DIMS:
        raise ValueError(f"corrupt scatter header: ndim {ndim}")
    shape = tuple(int(n) for n in meta[1 : 1 + ndim])
    name = np.ascontiguousarray(meta[_NAME_OFFSET:]).view(np.uint8).tobytes().rstrip(b"\0").decode()
    return shape, dtype_from_name(name)


def dtype_code(dtype: np.dtype[Any]) -> int:
    """A stable integer naming `dtype` (its name packed into 8 bytes) for point-to-point headers."""
    raw = dtype.name.encode()[:8].ljust(8, b"\0")
    return int(np.frombuffer(raw, dtype=np.int64)[0])


def encode_p2p_header(tag: int, nbytes: int, dtype: np.dtype[Any]) -> np.ndarray:
    """The header a send puts in front of its payload, so that recv can detect a mismatched send."""
    return np.array([_P2P_MAGIC, tag, nbytes, dtype_code(dtype)], dtype=np.int64)


def check_p2p_header(header: np.ndarray, tag: int, nbytes: int, dtype: np.dtype[Any]) -> str | None:
    """None if `header` matches the recv's expectations, else what differs."""
    magic, got_tag, got_nbytes, got_code = (int(v) for v in header)
    if magic != _P2P_MAGIC:
        return "the peer's message has no axond header (did it call send?)"
    problems = []
    if got_tag != tag:
        problems.append(f"tag {got_tag} (expected {tag})")
    if got_nbytes != nbytes:
        problems.append(f"{got_nbytes} bytes (expected {nbytes})")
    if got_code != dtype_code(dtype):
        problems.append(f"a different dtype (expected {dtype.name})")
    if not problems:
        return None
    return (
        "the peer sent " + ", ".join(problems)
        + "; NCCL matches sends and recvs in order, so post them in the same order"
    )
