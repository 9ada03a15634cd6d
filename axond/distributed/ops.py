"""The vocabulary every backend shares: operation, dtype and reduction codes, and how a call is described.

The codes are what the tcp backend writes in its frame headers (`backends.tcp.transport.wire`) and what the mock
backend's hub compares, so that a member calling a different collective, dtype or size is named on every rank.
Append only: codes travel between processes.
"""

from __future__ import annotations

from enum import IntEnum

import ml_dtypes
import numpy as np


class Op(IntEnum):
    """Which operation a call (or a frame) belongs to."""

    ALL_REDUCE = 1
    BROADCAST = 2
    REDUCE = 3
    ALL_GATHER = 4
    REDUCE_SCATTER = 5
    GATHER = 6
    SCATTER = 7
    ALL_TO_ALL = 8
    SEND = 9
    BARRIER = 10
    ABORT = 11


OP_NAMES = {op: op.name.lower() for op in Op}
OP_BY_NAME = {name: op for op, name in OP_NAMES.items()}
ROOTED = {Op.BROADCAST: "src", Op.REDUCE: "dst", Op.GATHER: "dst", Op.SCATTER: "src", Op.SEND: "tag"}
"""Ops whose aux field is a rank or tag, by what it is called in messages."""
UNEVEN_ALL_TO_ALL = -1
"""The aux of an all_to_all with split sizes (negative; frames carry `uneven_aux` and their block's own count)."""


def uneven_aux(back: int) -> int:
    """aux of one block of an all_to_all with split sizes: negative, carrying the element count the sender
    expects back from the receiver, so that both sides of a pair check both directions (modulo 2**31 - 1)."""
    return -1 - back % (2**31 - 1)


def uneven_back(aux: int) -> int:
    """The element count carried by `uneven_aux`."""
    return -1 - aux


DTYPES: list[np.dtype] = [
    np.dtype(t)
    for t in (
        "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
] + [np.dtype(ml_dtypes.bfloat16)]
"""Dtypes the host backends move; the index (plus one) is the dtype code (append only: codes are on the wire)."""
DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(DTYPES)}
REDUCE_CODES = {"sum": 1, "product": 2, "min": 3, "max": 4, "avg": 5, "band": 6, "bor": 7, "bxor": 8}
"""`ReduceOp.value` -> reduce code (0: no reduction)."""
REDUCE_NAMES = {v: k.upper() for k, v in REDUCE_CODES.items()}


def dtype_code(dtype: np.dtype) -> int:
    """Code of `dtype`, or a clear error listing the supported ones."""
    code = DTYPE_CODE.get(dtype) if isinstance(dtype, np.dtype) else DTYPE_CODE.get(np.dtype(dtype))
    if code is None:
        names = ", ".join(str(d) for d in DTYPES)
        raise TypeError(f"dtype {dtype} cannot be communicated; use one of {names}")
    return code


def dtype_name(code: int) -> str:
    """The dtype of code `code` as NumPy writes it (or "dtype#N" for an unknown code)."""
    return str(DTYPES[code - 1]) if 0 < code <= len(DTYPES) else f"dtype#{code}"


def describe(op: int, dtype: int, count: int, redop: int, aux: int) -> str:
    """Human form of one side of an operation, used in mismatch errors."""
    try:
        o = Op(op)
        name = OP_NAMES[o]
    except ValueError:
        return f"an unknown operation (code {op}; not an axond peer?)"
    extra = ""
    if redop:
        extra += f" with {REDUCE_NAMES.get(redop, redop)}"
    if o in ROOTED:
        extra += f" {ROOTED[o]}={aux}"
    if dtype == 0:
        return f"{name}{extra} (metadata)"
    if o is Op.ALL_TO_ALL and aux < 0:
        return f"{name} with split sizes ({dtype_name(dtype)})"
    return f"{name}{extra} ({dtype_name(dtype)}, {count} elements)"
