"""The vocabulary every backend shares: operation, dtype and reduction codes, and how a call is described.

The codes are what the tcp backend writes in its frame headers (`backends.tcp.transport.wire`) and what the mock
backend's hub compares, so that a member calling a different collective, dtype or size is named on every rank.
Append only: codes travel between processes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from enum import IntEnum
from typing import overload

import numpy as np

from axond.distributed.numerics.bf16 import NAME as BFLOAT16_NAME
from axond.distributed.numerics.bf16 import bfloat16, is_bfloat16


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


DTYPE_NAMES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
               "float64", "complex64", "complex128", BFLOAT16_NAME)
"""Dtypes the host backends move; the index (plus one) is the dtype code (append only: codes are on the wire)."""


class _Dtypes(Sequence[np.dtype]):
    """`DTYPE_NAMES` as NumPy dtypes; bfloat16's is made (importing ml_dtypes) only when it is asked for."""

    def __init__(self) -> None:
        self._numpy = [np.dtype(name) for name in DTYPE_NAMES[:-1]]

    def __len__(self) -> int:
        return len(DTYPE_NAMES)

    @overload
    def __getitem__(self, i: int) -> np.dtype: ...
    @overload
    def __getitem__(self, i: slice) -> list[np.dtype]: ...
    def __getitem__(self, i: int | slice) -> np.dtype | list[np.dtype]:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        if i in (len(self._numpy), -1):
            return bfloat16()
        return self._numpy[i]

    def __iter__(self) -> Iterator[np.dtype]:
        return (self[i] for i in range(len(self)))


DTYPES = _Dtypes()
DTYPE_CODE: dict[np.dtype, int] = {np.dtype(name): i + 1 for i, name in enumerate(DTYPE_NAMES[:-1])}
"""dtype -> its code; bfloat16 is added when a rank first moves it (`dtype_code`), ml_dtypes being imported then."""
REDUCE_CODES = {"sum": 1, "product": 2, "min": 3, "max": 4, "avg": 5, "band": 6, "bor": 7, "bxor": 8}
"""`ReduceOp.value` -> reduce code (0: no reduction)."""
REDUCE_NAMES = {v: k.upper() for k, v in REDUCE_CODES.items()}


def dtype_code(dtype: np.dtype) -> int:
    """Code of `dtype`, or a clear error listing the supported ones."""
    dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    code = DTYPE_CODE.get(dtype)
    if code is None and is_bfloat16(dtype):
        code = DTYPE_CODE[dtype] = len(DTYPE_NAMES)
    if code is None:
        names = ", ".join(DTYPE_NAMES)
        raise TypeError(f"dtype {dtype} cannot be communicated; use one of {names}")
    return code


def dtype_name(code: int) -> str:
    """The dtype of code `code` as NumPy writes it (or "dtype#N" for an unknown code)."""
    return DTYPE_NAMES[code - 1] if 0 < code <= len(DTYPE_NAMES) else f"dtype#{code}"


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
