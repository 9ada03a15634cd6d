"""torch's coalesced forms on "axond" with torch's layouts, sparse all_reduce and point-to-point as gloo runs them
(against gloo), and the group as torch's own backends present themselves: device types, sequence numbers,
profiler events, the group's monitored_barrier. Three real processes on loopback, one spawn for the whole file.

Point-to-point: batch_isend_irecv and isend/irecv posted in any order never deadlock (a send is posted at once,
never behind a queued receive), sends and receives match per tag in any order of tags, and recv/irecv without src
take the first sender and say who it was."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed (pip install -e '.[torch]')")

import torch_backend_form_cases as cases  # noqa: E402
import torch_backend_p2p_cases as p2p  # noqa: E402
import torch_cases  # noqa: E402
from axond.testing import collect_from_processes  # noqa: E402
from axond.torch import DEVICES  # noqa: E402

pytestmark = pytest.mark.slow  # torch ranks in real processes beside gloo


N = 3


def _ranks(body: object, n: int = N) -> list[object]:
    items, codes = collect_from_processes(functools.partial(torch_cases.run, body), n, expect=n, timeout=90.0)
    failures = [res for _, ok, res in items if not ok]
    assert not failures, failures[0]
    assert codes == [0] * n, codes
    return [res for _, _, res in sorted(items, key=lambda item: item[0])]


def _all(rank: int, n: int, gloo: object) -> dict[str, object]:
    """Every case in turn (sequence numbers first: point-to-point counts differ per rank; monitored last)."""
    out = {"devices": cases.device_types_and_sequence_numbers(rank, n, gloo)}
    out["coalesced"] = cases.coalesced(rank, n, gloo)
    out["events"] = cases.profiler_events(rank, n, gloo)
    out["sparse"] = cases.sparse(rank, n, gloo)
    out["p2p"] = p2p.point_to_point(rank, n, gloo)
    out["monitored"] = cases.monitored(rank, n, gloo)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    return _ranks(_all)  # type: ignore[return-value]


def test_coalesced_forms_have_torchs_layout(results: list[dict[str, object]]) -> None:
    """all_gather_coalesced with as many inputs as ranks once came back transposed without an error."""
    assert [r["coalesced"] for r in results] == [[]] * N


def test_sparse_all_reduce_as_gloo(results: list[dict[str, object]]) -> None:
    """As gloo: every rank's indices and values gathered, duplicates summed, into the caller's sparse tensor."""
    assert [r["sparse"] for r in results] == [[]] * N


def test_the_groups_monitored_barrier_names_the_missing_rank(results: list[dict[str, object]]) -> None:
    """torch's `dist.monitored_barrier` is gloo's alone (it checks the backend's name); the group's method runs
    axond's."""
    kind, message = results[0]["monitored"]  # type: ignore[misc]
    assert kind == "TorchDistributedError" and "rank 1" in message, (kind, message)


def test_device_types_and_sequence_numbers_as_torchs_backends(results: list[dict[str, object]]) -> None:
    for r in results:
        devices = r["devices"]
        # as registered (["cpu"], plus "cuda" where a GPU and CuPy are there); gloo lists cpu (and cuda) too
        assert devices["device_types"] == devices["capability"] == DEVICES, devices  # type: ignore[index]
        assert "cpu" in devices["gloo"] and devices["backend"], devices  # type: ignore[index,operator]
    seqs = [r["devices"]["seq"] for r in results]  # type: ignore[index]
    assert all(seq == seqs[0] for seq in seqs) and seqs[0][1] == seqs[0][0] + 3, seqs


def test_every_op_records_a_profiler_event(results: list[dict[str, object]]) -> None:
    common = {"axond:all_reduce", "axond:broadcast", "axond:all_gather", "axond:all_gather_into_tensor",
              "axond:reduce_scatter_tensor", "axond:reduce", "axond:all_to_all_single", "axond:barrier"}
    assert set(results[0]["events"]) == common | {"axond:send"}, results[0]["events"]  # type: ignore[arg-type]
    assert set(results[1]["events"]) == common | {"axond:recv"}, results[1]["events"]  # type: ignore[arg-type]
    assert set(results[2]["events"]) == common, results[2]["events"]  # type: ignore[arg-type]


@pytest.mark.parametrize("program", ["batch", "batch_tags", "irecv_first", "tags_out_of_order", "any_source"])
def test_point_to_point_as_gloo(results: list[dict[str, object]], program: str) -> None:
    for rank, r in enumerate(results):
        ours, theirs = r["p2p"][program]  # type: ignore[index]
        assert ours == theirs, (rank, program, ours, theirs)
    if program == "any_source":
        got = results[0]["p2p"][program][0]  # type: ignore[index]
        assert got == [[1.0, 1.0], [1.0, 10.0], [2.0, 2.0], [2.0, 20.0]], got
