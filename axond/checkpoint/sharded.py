"""`ShardedTensor`: this rank's pieces of one global tensor, each a box (offsets + a local array view).

Every wrapper's parameters and optimizer state are expressed this way: a DDP replica holds one box
covering the whole tensor, a tensor-parallel layer a block of rows or columns, and FSDP / ZeRO-1 a
flat range of the row-major tensor, cut here into at most `2 * ndim - 1` boxes. The views alias the
live arrays, so loading into them updates the model and optimizer in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from axond.nn.device import Array

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, lengths) of a block of a global tensor."""


@dataclass
class Chunk:
    """One box of a global tensor held by this rank: `array` (a view, shape `lengths`) sits at `offsets`."""

    offsets: tuple[int, ...]
    array: Array

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.array.shape)


@dataclass
class ShardedTensor:
    """The chunks of a tensor of `global_shape` and `dtype` that this rank holds (possibly none)."""

    global_shape: tuple[int, ...]
    dtype: np.dtype[Any]
    chunks: list[Chunk] = field(default_factory=list)

    @classmethod
    def full(cls, array: Array) -> ShardedTensor:
        """A tensor held whole by this rank (replicated data: a DDP parameter, a buffer)."""
        return cls(tuple(int(d) for d in array.shape), np.dtype(array.dtype), [Chunk((0,) * array.ndim, array)])

    @classmethod
    def from_flat_range(cls, global_shape: Sequence[int], start: int, flat: Array) -> ShardedTensor:
        """Elements [start, start + flat.size) of the row-major flattening of a `global_shape` tensor.

        `flat` is a contiguous 1-d view (an FSDP or ZeRO shard's slice); the chunks are views of it.
        """
        shape = tuple(int(d) for d in global_shape)
        chunks = [Chunk(off, flat[lo - start : lo - start + math.prod(lens)].reshape(lens))
                  for off, lens, lo in flat_range_boxes(shape, start, start + int(flat.size))]
        return cls(shape, np.dtype(flat.dtype), chunks)

    def __repr__(self) -> str:
        boxes = ", ".join(f"{c.offsets}+{c.lengths}" for c in self.chunks)
        return f"ShardedTensor(shape={self.global_shape}, dtype={self.dtype}, chunks=[{boxes}])"


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Boxes (offsets, lengths, flat start) covering flat elements [start, stop) of a row-major `shape`, in order."""
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of {total} elements")
    if start == stop:
        return []
    if not shape:
        return [((), (), 0)]
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []

    def walk(prefix: tuple[int, ...], dims: tuple[int, ...], lo: int, hi: int, base: int) -> None:
        inner = math.prod(dims[1:])
        first, last = lo // inner, (hi - 1) // inner
        ones = (1,) * len(prefix)
        zeros = (0,) * (len(dims) - 1)
        if (lo % inner == 0 and hi % inner == 0) or len(dims) == 1:
            out.append((prefix + (first,) + zeros, ones + (last - first + 1,) + dims[1:], base + lo))
            return
        if first == last:
            walk(prefix + (first,), dims[1:], lo - first * inner, hi - first * inner, base + first * inner)
            return
        if lo % inner:
            walk(prefix + (first,), dims[1:], lo - first * inner, inner, base + first * inner)
            first += 1
        full_hi = last if hi % inner else last + 1
        if full_hi > first:
            out.append((prefix + (first,) + zeros, ones + (full_hi - first,) + dims[1:], base + first * inner))
        if hi % inner:
            walk(prefix + (last,), dims[1:], 0, hi - last * inner, base + last * inner)

    walk((), shape, start, stop, 0)
    return out


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of two boxes, or None when they do not overlap."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if lo >= hi:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return tuple(offs), tuple(lens)


def local_slices(box: Box, within: tuple[int, ...]) -> tuple[slice, ...]:
    """Slices selecting `box` inside a block that starts at offsets `within`."""
    return tuple(slice(o - w, o - w + n) for o, n, w in zip(box[0], box[1], within))


def iter_leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) for a nested dict; paths join keys with "/" (keys must be strings without "/")."""
    if not isinstance(tree, dict):
        yield prefix, tree
        return
    for key, value in tree.items():
        if not isinstance(key, str) or "/" in key or not key:
            raise ValueError(f"checkpoint state keys must be non-empty strings without '/', got {key!r} under {prefix!r}")
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict):
            yield from iter_leaves(value, path)
        else:
            yield path, value


def set_leaf(tree: dict[str, Any], path: str, value: Any) -> None:
    """Replace the leaf at `path` (which must exist) in a nested dict."""
    *parents, last = path.split("/")
    node = tree
    for key in parents:
        node = node[key]
    node[last] = value


def is_array(value: Any) -> bool:
    """A NumPy or CuPy array (anything with shape, dtype and the array protocol)."""
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, (np.generic, ShardedTensor))


def as_sharded(value: Any) -> ShardedTensor | None:
    """The leaf as a ShardedTensor (a plain array is held whole), or None for a non-tensor leaf."""
    if isinstance(value, ShardedTensor):
        return value
    if is_array(value):
        return ShardedTensor.full(value)
    return None
