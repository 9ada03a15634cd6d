"""Rank bodies of the point-to-point tests in tests/torch/test_torch_backend_forms.py: point-to-point on "axond" as gloo
runs it (each rank also joins gloo, see `torch_cases.join`, and runs the same program there first)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _batch(rank: int, n: int, g: Any, tags: bool) -> list[float]:
    """torch's own test_batch_isend_irecv_gloo(_tags): every rank posts irecv before isend, for every peer."""
    ops, received = [], []
    for peer in range(n):
        if peer == rank:
            continue
        got = torch.full((4,), -1.0)
        received.append(got)
        ops.append(dist.P2POp(dist.irecv, got, peer, g, tag=peer if tags else 0))
        ops.append(dist.P2POp(dist.isend, torch.full((4,), float(rank + 1)), peer, g, tag=rank if tags else 0))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return [float(t[0]) for t in received]


def _irecv_first(rank: int, n: int, g: Any) -> list[float]:
    """Every rank posts irecv from its left, then isend to its right, then waits: a ring that deadlocks if a send
    waits behind the receive posted before it."""
    left, right = (rank - 1) % n, (rank + 1) % n
    got = torch.zeros(1 << 16)  # over one socket buffer, so the send cannot hide in the kernel
    r = dist.irecv(got, left, group=g)
    s = dist.isend(torch.full((1 << 16,), float(rank)), right, group=g)
    r.wait()
    s.wait()
    return [float(got[0]), float(got[-1])]


def _tags_out_of_order(rank: int, n: int, g: Any) -> list[float]:
    """Rank 0 sends tags 1, 2, 3; rank 1 receives them 3, 1, 2: matched by tag, as gloo does."""
    if rank == 0:
        works = [dist.isend(torch.full((3,), float(tag)), 1, group=g, tag=tag) for tag in (1, 2, 3)]
        for w in works:
            w.wait()
        return []
    if rank == 1:
        out = []
        for tag in (3, 1, 2):
            t = torch.zeros(3)
            dist.recv(t, 0, group=g, tag=tag)
            out.append(float(t[0]))
        return out
    return []


def _any_source(rank: int, n: int, g: Any) -> list[list[float]]:
    """Rank 0 receives from any source (recv and irecv) the sends of every other rank; [sender, value] pairs."""
    if rank != 0:
        dist.send(torch.full((5,), float(rank)), 0, group=g)
        dist.send(torch.full((5,), float(rank * 10)), 0, group=g)
        return []
    got = []
    for i in range(2 * (n - 1)):
        t = torch.zeros(5)
        if i % 2:
            w = dist.irecv(t, group=g)
            w.wait()
            sender = w._source_rank()
        else:
            sender = dist.recv(t, group=g)
        got.append([float(sender), float(t[0])])
    return sorted(got)


def point_to_point(rank: int, n: int, gloo: Any) -> dict[str, Any]:
    """Each program on gloo, then on axond; both results."""
    out: dict[str, Any] = {}
    for name, body in (("batch", lambda g: _batch(rank, n, g, False)),
                       ("batch_tags", lambda g: _batch(rank, n, g, True)),
                       ("irecv_first", lambda g: _irecv_first(rank, n, g)),
                       ("tags_out_of_order", lambda g: _tags_out_of_order(rank, n, g)),
                       ("any_source", lambda g: _any_source(rank, n, g))):
        theirs = body(gloo)
        dist.barrier()
        ours = body(dist.group.WORLD)
        dist.barrier()
        out[name] = (ours, theirs)
    return out
