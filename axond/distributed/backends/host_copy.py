"""Host memory copies that step around one slow case of x86 string copies (`rep movsb`).

On AMD EPYC (Zen, ERMS/FSRM) glibc's memcpy, which NumPy's contiguous copies call from 4 KiB up to about the L2
size, and the kernel's copies behind `process_vm_readv` run 7-12x slower when the destination starts 1 to 31 bytes
after the source modulo the 4 KiB page. Measured on this project's 2-core EPYC VM (`python bench/host_copy.py`):
a 64 KiB copy 34 us against 3 us, a 256 KiB one 130 against 11, a `process_vm_readv` of 1 MiB 585 us against 75.

Ordinary programs hit it: malloc puts a 16-byte header before each block, so two arrays allocated one after the
other whose size is a multiple of the page are 16 bytes apart modulo the page (`x = np.ones(16384, np.float32);
out = np.empty((2, 16384), np.float32)`, then `out[0] = x`). `copy` runs such copies as NumPy's vector loop over
the bytes instead (`np.positive` on uint8: the same bits, at memcpy's speed); `slow_distance` tells the
single-copy reader when to read through a bounce buffer instead.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from axond.distributed.policy import HOST_COPY_MAX_BYTES as MAX_BYTES
from axond.distributed.policy import HOST_COPY_MIN_BYTES as MIN_BYTES
from axond.distributed.policy import HOST_COPY_SLOW_DISTANCE as SLOW_DISTANCE
from axond.distributed.policy import STRING_MIN_BYTES

PAGE = 4096


def _slow_address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _data_field() -> int | None:
    """Where NumPy's array object keeps its data pointer (right after the object header, `PyArrayObject.data`), if
    checked to be so here; reading it costs ~0.3 us where `__array_interface__` costs ~3."""
    offset = object.__basicsize__
    probes = [np.arange(8, dtype=np.int64)[k:] for k in range(3)]
    try:
        if all(ctypes.c_void_p.from_address(id(p) + offset).value == _slow_address(p) for p in probes):
            return offset
    except (ValueError, OSError):  # pragma: no cover - an unusual interpreter
        pass
    return None  # pragma: no cover


_FIELD = _data_field()
_POINTER = ctypes.c_void_p.from_address


def address(a: np.ndarray) -> int:
    """The address of `a`'s first byte."""
    if _FIELD is None:  # pragma: no cover
        return _slow_address(a)
    return _POINTER(id(a) + _FIELD).value or 0


def slow_distance(dst: int, src: int) -> bool:
    """Whether a string copy from address `src` to `dst` takes the slow case."""
    return 0 < (dst - src) % PAGE < SLOW_DISTANCE


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """`np.copyto(dst, src)` for arrays of one shape and dtype, without the slow case of `rep movsb`.

    The innermost axis must be contiguous for the vector loop; a 2-D copy (blocks of an output from the slots of an
    arena) is looked at row by row. Anything else takes `np.copyto`.
    """
    nbytes = dst.nbytes
    if nbytes >= MIN_BYTES and (dst.ndim == 2 or (nbytes <= MAX_BYTES and dst.ndim == 1
                                                  and 0 < (address(dst) - address(src)) % PAGE < SLOW_DISTANCE)):
        _careful(dst, src)
    else:
        np.copyto(dst, src)


def _careful(dst: np.ndarray, src: np.ndarray) -> None:
    """`copy` of a 1-D array at a slow distance, or of a 2-D one."""
    if dst.strides[-1] != dst.itemsize or src.strides[-1] != src.itemsize or dst.shape != src.shape:
        np.copyto(dst, src)
    elif dst.ndim == 1:
        np.positive(src.view(np.uint8), out=dst.view(np.uint8))
    elif dst.shape[0] and dst.nbytes // dst.shape[0] <= MAX_BYTES:
        gap, step = address(dst) - address(src), dst.strides[0] - src.strides[0]
        for k in range(dst.shape[0]):
            if 0 < (gap + k * step) % PAGE < SLOW_DISTANCE:
                np.positive(src[k].view(np.uint8), out=dst[k].view(np.uint8))
            else:
                np.copyto(dst[k], src[k])
    else:
        np.copyto(dst, src)


def _compiled(name: str) -> Any:
    """Function `name` of the compiled helper (`_hostcopy`), or None where the install did not build it (or built it
    from an older source without that function: the pip install line builds it again)."""
    try:
        from axond.distributed.backends import _hostcopy
    except ImportError:  # pragma: no cover - no C compiler at install
        return None
    return getattr(_hostcopy, name, None)


_MOVSB = _compiled("copy")
_CHANGED = _compiled("copy_changed")
_STREAM = _compiled("stream")


def large_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """`copy` of two C-contiguous arrays of the same bytes, with `rep movsb` from STRING_MIN_BYTES at distances
    where it is fast (the compiled helper; without it, `copy`)."""
    nbytes = dst.nbytes
    if _MOVSB is None or nbytes < STRING_MIN_BYTES or not (dst.flags.c_contiguous and src.flags.c_contiguous):
        copy(dst, src)
        return
    if src.nbytes != nbytes:
        raise ValueError(f"large_copy: {src.nbytes} bytes into {nbytes}")
    to, of = address(dst), address(src)
    if slow_distance(to, of):
        copy(dst, src)
    else:
        _MOVSB(to, of, nbytes)


def copy_changed(dst: np.ndarray, src: np.ndarray) -> int:
    """`copy` of two C-contiguous arrays of the same bytes into memory that other cores read (an arena slot) that
    skips the 4 KiB blocks `dst` already holds up to the first that differs, and copies the rest at once (the compiled
    helper; without it, or at a slow distance, a plain copy); the bytes written. Where the data did not change since
    the last copy into `dst` (a broadcast of an unchanged buffer), nothing is written, so the slot's cache lines stay
    shared with the cores that read them, which read them from their own caches instead of fetching them again; where
    it did, the first block differs at its first bytes in the common case, so the check reads one line."""
    nbytes = dst.nbytes
    if _CHANGED is None or not (dst.flags.c_contiguous and src.flags.c_contiguous) or src.nbytes != nbytes:
        copy(dst, src)
        return nbytes
    to, of = address(dst), address(src)
    if slow_distance(to, of):
        copy(dst, src)
        return nbytes
    written: int = _CHANGED(to, of, nbytes)
    return written


def stream_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """`np.copyto` of two C-contiguous arrays of the same bytes with non-temporal stores (the compiled helper; without
    it, or for arrays that are not both contiguous, `copy`): for large copies into memory this process does not read
    again soon (a snapshot of the training state). glibc's memcpy streams only above a threshold derived from the
    last-level cache size it is told of (190 MB on this project's VM): below it, every destination line is read into
    the cache before it is written, which nearly doubles the memory traffic of a copy whose source is not in cache
    (15.7 MB: 2.4 ms of CPU against 1.4, `python bench/shard_copies.py --memcpy-only`)."""
    if dst.dtype != src.dtype or dst.shape != src.shape:
        np.copyto(dst, src)  # a cast or a broadcast: NumPy's
    elif _STREAM is None or not (dst.flags.c_contiguous and src.flags.c_contiguous):
        copy(dst, src)
    else:
        _STREAM(address(dst), address(src), dst.nbytes)
