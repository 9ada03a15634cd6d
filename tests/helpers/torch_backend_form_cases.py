"""Rank bodies of tests/torch/test_torch_backend_forms.py: torch's coalesced forms, device types, sequence numbers and
profiler events of "axond" next to gloo's (each rank joins both, see `torch_cases.join`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torch_cases import _values


def coalesced(rank: int, n: int, gloo: Any) -> list[str]:
    """Every coalesced form on both groups; the cases whose results differ."""
    world = dist.group.WORLD
    bad: list[str] = []
    for count in (n, n + 1, 1):  # as many inputs as ranks: the layout a transposition would not change the shape of
        ins = [_values(torch.float32, (3 + j,), rank, salt=j) for j in range(count)]
        results = []
        for g in (world, gloo):
            outs = [[torch.zeros(3 + j) for j in range(count)] for _ in range(n)]
            dist.all_gather_coalesced(outs, ins, group=g)
            results.append(outs)
        if any(not torch.equal(a, b) for ra, rb in zip(*results) for a, b in zip(ra, rb)):
            bad.append(f"all_gather_coalesced x{count}: {results[0]} != {results[1]}")
        for r in range(n):  # the layout itself: outs[r][j] is rank r's input j
            want = [_values(torch.float32, (3 + j,), r, salt=j) for j in range(count)]
            if any(not torch.equal(a, b) for a, b in zip(results[0][r], want)):
                bad.append(f"all_gather_coalesced x{count}: row {r} is not rank {r}'s inputs")
        reduced = []
        for g in (world, gloo):
            ts = [t.clone() for t in ins]
            dist.all_reduce_coalesced(ts, group=g)
            reduced.append(ts)
        if any(not torch.equal(a, b) for a, b in zip(*reduced)):
            bad.append(f"all_reduce_coalesced x{count}")
        parts = [_values(torch.float64, (2 * (j + 1),), rank, salt=j) for j in range(count)]
        wholes = [_values(torch.float64, (n * 2 * (j + 1),), rank, salt=j) for j in range(count)]
        for name, make_out, inputs in (("allgather_into_tensor_coalesced", lambda w, p: torch.zeros_like(w), parts),
                                       ("reduce_scatter_tensor_coalesced", lambda w, p: torch.zeros_like(p), wholes)):
            got = []
            for g in (world, gloo):
                outs = [make_out(w, p) for w, p in zip(wholes, parts)]
                getattr(g, name)(outs, inputs).wait()
                got.append(outs)
            if any(not torch.equal(a, b) for a, b in zip(*got)):
                bad.append(f"{name} x{count}: {got[0]} != {got[1]}")
    return bad


def device_types_and_sequence_numbers(rank: int, n: int, gloo: Any) -> dict[str, Any]:
    world = dist.group.WORLD
    before = world._get_sequence_number_for_group()
    dist.all_reduce(torch.ones(4))
    dist.broadcast(torch.ones(4), src=0)
    dist.barrier()
    return {"device_types": [d.type for d in world._device_types], "gloo": [d.type for d in gloo._device_types],
            "capability": dist.distributed_c10d._device_capability(), "backend": world._get_backend(
                torch.device("cpu")) is world, "seq": [before, world._get_sequence_number_for_group()]}


def profiler_events(rank: int, n: int, gloo: Any) -> list[str]:
    """The `axond:*` events a torch profiler records for every collective and point-to-point op."""
    t = torch.ones(n << 10)  # divisible by the group size
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        dist.broadcast(t, src=0)
        dist.all_gather([torch.zeros_like(t) for _ in range(n)], t)
        dist.all_gather_into_tensor(torch.zeros(n * t.numel()), t)
        dist.reduce_scatter_tensor(torch.zeros(t.numel() // n), t)
        dist.reduce(t, dst=0)
        dist.all_to_all_single(torch.zeros_like(t), t)
        dist.barrier()
        if rank == 0:
            dist.send(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
    return sorted({e.name for e in prof.events() if e.name.startswith("axond:")})


def sparse(rank: int, n: int, gloo: Any) -> list[str]:
    """Sparse all_reduce (SUM) on both groups, ranks holding different numbers of nonzeros (rank 2's none), with
    overlapping indices and a dense dimension; the cases whose results differ."""
    bad = []
    for dtype in (torch.float32, torch.float64, torch.int64):
        nnz = [3, 1, 0][rank % 3]
        indices = torch.tensor([[(rank + 2 * i) % 5 for i in range(nnz)], [i % 2 for i in range(nnz)]],
                               dtype=torch.int64).reshape(2, nnz)
        values = (torch.arange(nnz * 3, dtype=torch.float64).reshape(nnz, 3) + rank).to(dtype)
        results = []
        for g in (dist.group.WORLD, gloo):
            t = torch.sparse_coo_tensor(indices, values, (5, 2, 3))
            dist.all_reduce(t, group=g)
            results.append(t.coalesce())
        ours, theirs = results
        if not (torch.equal(ours.indices(), theirs.indices()) and torch.equal(ours.values(), theirs.values())):
            bad.append(f"sparse all_reduce {dtype}: {ours} != {theirs}")
    return bad


def monitored(rank: int, n: int, gloo: Any) -> list[str]:
    """The group's `monitored_barrier`: passes when every rank comes; then rank 1 stays away and rank 0's raises
    naming it (torch's error classes too), within the timeout given. Run last: the groups are spent after."""
    from datetime import timedelta

    world = dist.group.WORLD
    world.monitored_barrier(timedelta(seconds=10))  # type: ignore[union-attr]
    if rank != 0:
        return []
    try:
        world.monitored_barrier(timedelta(seconds=1))  # type: ignore[union-attr]
    except dist.DistBackendError as e:
        return [type(e).__name__, str(e)]
    return ["no error"]
