"""Flattening: where each array sits in one flat buffer, padded so it splits into equal shards.

`FlatLayout` is pure arithmetic plus a few copies done per array (never per element): the
concatenation of a unit's (or an optimizer's) arrays, padded with zeros up to `world * shard_numel`,
is cut into `world` equal shards, shard r covering `[r * shard_numel, (r + 1) * shard_numel)`.
FSDP and ZeRO-1 both use it, so both agree on which rank owns which element.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from axond.nn.device import Array, array_module, empty_on


def shard_numel(numel: int, world: int) -> int:
    """Elements per shard: ceil(numel / world), at least 1 so every rank holds a real buffer."""
    if world < 1:
        raise ValueError(f"the shard group size must be >= 1, got {world}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return max(1, -(-numel // world))


class FlatLayout:
    """Offsets of `shapes` in the flat concatenation, and its split into `world` padded shards."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], world: int) -> None:
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.numels = [_prod(s) for s in self.shapes]
        self.offsets: list[int] = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        """Unpadded elements."""
        self.world = world
        self.shard_numel = shard_numel(total, world)
        self.padded_numel = self.shard_numel * world
        """Elements of the flat buffer: `world` shards of `shard_numel`."""

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of shard `rank` in flat (padded) coordinates."""
        if not 0 <= rank < self.world:
            raise ValueError(f"shard rank {rank} is outside a shard group of {self.world}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def views(self, flat: Array) -> list[Array]:
        """Each array as a view into `flat` (length >= numel), in its own shape."""
        return [flat[o : o + n].reshape(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def copy_range(self, arrays: Sequence[Array | None], start: int, stop: int, out: Array) -> Array:
        """out[:] = (concatenation of `arrays`, zero-padded)[start:stop]; a None array reads as zeros."""
        if out.shape != (stop - start,):
            raise ValueError(f"copy_range out must have shape ({stop - start},), got {tuple(out.shape)}")
        self._check(arrays)
        for a, off, n in zip(arrays, self.offsets, self.numels):
            lo, hi = max(start, off), min(stop, off + n)
            if lo >= hi:
                continue
            if a is None:
                out[lo - start : hi - start] = 0
            else:
                out[lo - start : hi - start] = a.reshape(-1)[lo - off : hi - off]
        covered = max(start, min(stop, self.numel))
        out[covered - start :] = 0  # the padding (every element before it was written above)
        return out

    def flatten(self, arrays: Sequence[Array | None], like: Array) -> Array:
        """A new padded flat buffer (on `like`'s device, with its dtype) holding `arrays`."""
        flat = empty_on(like, self.padded_numel, like.dtype)
        return self.copy_range(arrays, 0, self.padded_numel, flat)

    def shard_of(self, arrays: Sequence[Array | None], rank: int, like: Array) -> Array:
        """A new array with shard `rank` of the flattened `arrays` (no full flat buffer is built)."""
        start, stop = self.shard_range(rank)
        return self.copy_range(arrays, start, stop, empty_on(like, stop - start, like.dtype))

    def unflatten_into(self, flat: Array, arrays: Sequence[Array]) -> None:
        """Copy the flat buffer back into `arrays` in place."""
        self._check(arrays)
        for a, view in zip(arrays, self.views(flat)):
            a[...] = view

    def pad_shard(self, full: Array, rank: int) -> Array:
        """Shard `rank` of an unpadded flat array of `numel` elements (e.g. a consolidated state)."""
        if tuple(full.shape) != (self.numel,):
            raise ValueError(f"expected a flat array of {self.numel} elements, got shape {tuple(full.shape)}")
        start, stop = self.shard_range(rank)
        xp = array_module(full)
        out = xp.zeros(stop - start, dtype=full.dtype)
        hi = min(stop, self.numel)
        if start < hi:
            out[: hi - start] = full[start:hi]
        return out

    def _check(self, arrays: Sequence[Any]) -> None:
        if len(arrays) != len(self.shapes):
            raise ValueError(f"layout of {len(self.shapes)} arrays got {len(arrays)}")


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
