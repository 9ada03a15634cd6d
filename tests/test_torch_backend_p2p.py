"""Point-to-point on "axond" as gloo runs it, three ranks on loopback: batch_isend_irecv and isend/irecv posted
in any order never deadlock (a send is posted at once, never behind a queued receive), sends and receives match
per tag in any order of tags, and recv/irecv without src take the first sender and say who it was."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed (pip install -e '.[torch]')")

import torch_backend_p2p_cases as cases  # noqa: E402
import torch_cases  # noqa: E402
from axond.testing import collect_from_processes  # noqa: E402

N = 3


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    items, codes = collect_from_processes(functools.partial(torch_cases.run, cases.point_to_point), N, expect=N,
                                          timeout=90.0)
    failures = [res for _, ok, res in items if not ok]
    assert not failures, failures[0]
    assert codes == [0] * N, codes
    return [res for _, _, res in sorted(items, key=lambda item: item[0])]


@pytest.mark.parametrize("program", ["batch", "batch_tags", "irecv_first", "tags_out_of_order", "any_source"])
def test_point_to_point_as_gloo(results: list[dict[str, object]], program: str) -> None:
    for rank, r in enumerate(results):
        ours, theirs = r[program]  # type: ignore[misc]
        assert ours == theirs, (rank, program, ours, theirs)
    if program == "any_source":
        assert results[0][program][0] == [[1.0, 1.0], [1.0, 10.0], [2.0, 2.0], [2.0, 20.0]], results[0][program]  # type: ignore[index]
