"""`DeviceMesh`: the ranks of a group laid out as an n-dimensional grid, one process group per grid line.

A (2, 4) mesh named ("dp", "tp") over 8 ranks puts ranks 0-3 in the first row and 4-7 in the second:
`get_group("tp")` is this rank's row (4 ranks), `get_group("dp")` its column (2 ranks). Every rank
builds every line's group in the same order (`new_group` needs that), so constructing a mesh is a
collective call over `group`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from axond.distributed.api import default_group
from axond.distributed.process_group import ProcessGroup


class DeviceMesh:
    """The members of `group` (default: the world) arranged row-major in `shape`, with named dimensions."""

    def __init__(self, shape: Sequence[int], dim_names: Sequence[str] | None = None,
                 group: ProcessGroup | None = None) -> None:
        parent = group if group is not None else default_group()
        shape = tuple(int(s) for s in shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"mesh shape must be positive sizes, got {shape}")
        if math.prod(shape) != parent.size:
            raise ValueError(f"mesh shape {shape} holds {math.prod(shape)} ranks but group '{parent.name}' has "
                             f"{parent.size}; pick a shape whose product is the group size")
        names = tuple(dim_names) if dim_names is not None else tuple(f"dim{i}" for i in range(len(shape)))
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise ValueError(f"dim_names {names} must be {len(shape)} distinct names, one per mesh dimension")
        if parent.rank < 0:
            raise ValueError(f"global rank {parent.global_rank} is not a member of group '{parent.name}'")
        self.shape = shape
        self.dim_names = names
        self.parent = parent
        self.mesh = np.asarray(parent.ranks, dtype=np.int64).reshape(shape)
        """Global rank at each mesh coordinate."""
        where = np.argwhere(self.mesh == parent.global_rank)[0]
        self.coordinate = tuple(int(c) for c in where)
        """This rank's position in the mesh."""
        self._groups: list[ProcessGroup] = []
        for d in range(len(shape)):
            lines = np.moveaxis(self.mesh, d, -1).reshape(-1, shape[d])
            mine: ProcessGroup | None = None
            for line in lines:
                g = parent.new_group([int(r) for r in line])
                if g.rank >= 0:
                    mine = g
                else:
                    g.destroy()
            assert mine is not None  # every rank lies on exactly one line per dimension
            self._groups.append(mine)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"DeviceMesh({dims}, coordinate={self.coordinate})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _dim(self, dim: int | str) -> int:
        if isinstance(dim, str):
            if dim not in self.dim_names:
                raise KeyError(f"no mesh dimension named {dim!r}; the mesh has {self.dim_names}")
            return self.dim_names.index(dim)
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"mesh dimension {dim} is out of range for a {self.ndim}-d mesh")
        return dim % self.ndim

    def get_group(self, dim: int | str = 0) -> ProcessGroup:
        """The group of the ranks that share this rank's coordinates except along `dim`."""
        return self._groups[self._dim(dim)]

    def size(self, dim: int | str | None = None) -> int:
        """Number of ranks along `dim`, or in the whole mesh."""
        return int(self.mesh.size) if dim is None else self.shape[self._dim(dim)]

    def get_local_rank(self, dim: int | str = 0) -> int:
        """This rank's coordinate along `dim` (its rank in `get_group(dim)`)."""
        return self.coordinate[self._dim(dim)]

    def destroy(self) -> None:
        """Destroy the per-dimension groups (not the parent group)."""
        for g in self._groups:
            g.destroy()
        self._groups = []
