"""DeviceMesh on real TCP groups (ranks as threads): the grid layout, one group per line, and
collectives along each dimension reaching exactly the ranks of that line."""

from __future__ import annotations

import numpy as np
import pytest

from axond.distributed.process_group import ProcessGroup
from axond.parallel import DeviceMesh
from axond.testing import run_threads


def test_2x3_mesh_groups_and_collectives() -> None:
    def body(world: ProcessGroup) -> tuple:
        mesh = DeviceMesh((2, 3), ("dp", "tp"), group=world)
        try:
            tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
            x = np.array([world.rank], np.int64)
            tp.all_reduce(x)
            y = np.array([world.rank], np.int64)
            dp.all_reduce(y)
            return (mesh.coordinate, tp.ranks, dp.ranks, int(x[0]), int(y[0]),
                    mesh.get_local_rank("tp"), mesh.size("dp"), mesh.size(), mesh.get_group(1) is tp)
        finally:
            mesh.destroy()

    out = run_threads(body, 6, 60.0)
    for rank, (coord, tp_ranks, dp_ranks, tp_sum, dp_sum, tp_local, dp_size, total, same) in enumerate(out):
        row, col = divmod(rank, 3)
        assert coord == (row, col)
        assert tp_ranks == [3 * row, 3 * row + 1, 3 * row + 2]
        assert dp_ranks == [col, col + 3]
        assert tp_sum == sum(tp_ranks) and dp_sum == sum(dp_ranks)
        assert (tp_local, dp_size, total, same) == (col, 2, 6, True)


def test_mesh_rejects_bad_shapes() -> None:
    def body(world: ProcessGroup) -> list[str]:
        errors = []
        for shape, names in (((3,), None), ((2, 0), None), ((2,), ("a", "b"))):
            try:
                DeviceMesh(shape, names, group=world)
            except ValueError as e:
                errors.append(str(e))
        mesh = DeviceMesh((2,), ("dp",), group=world)
        try:
            with pytest.raises(KeyError, match="no mesh dimension named 'tp'"):
                mesh.get_group("tp")
            with pytest.raises(IndexError):
                mesh.get_group(1)
        finally:
            mesh.destroy()
        return errors

    errs = run_threads(body, 2, 30.0)[0]
    assert len(errs) == 3
    assert "holds 3 ranks" in errs[0] and "positive" in errs[1] and "distinct names" in errs[2]
