"""Re-sharding ZeRO-1 in memory after a membership change: every virtual shard's parameters and optimizer state at the
agreed step, from a survivor that carried it or from a buddy copy of a lost rank's block, to the new world's carriers.

Each survivor offers, per virtual shard: its own state (it carried the shard and applied every step up to the agreed
one), a buddy copy tagged with the agreed step, or an older copy it can advance with the gradients it kept
(`axond.train.buddy`); a replacement rank started by the worker of a lost rank offers that rank's copy in the worker
daemon's memory (`axond.train.daemon_copy`), one step old at most: the averaged gradient of the agreed step, which every
rank that applied it holds, is then broadcast to it to advance the copy. One all_gather of the offers tells every rank
the same provider per shard (the best offer, then the lowest rank); each shard then goes by one broadcast from its
provider: every rank takes its parameters (the flat buffer is whole again), its new carrier takes its state. Nothing is
read from storage. A shard nobody can offer was lost with both copies: `reassemble` returns it, and the trainer falls
back to a checkpoint or fails; it never goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from axond.distributed.process_group import ProcessGroup
from axond.parallel.zero.virtual import VirtualZero, carried
from axond.train.buddy import Holding

OWN, COPY, ADVANCED, NONE = 3, 2, 1, 0
"""What a rank offers for a shard, best first."""


def offers(zero: VirtualZero, holdings: list[Holding], agreed: int) -> np.ndarray:
    """This rank's offer (OWN, COPY, ADVANCED or NONE) for each virtual shard at the agreed step."""
    offer = np.full(zero.virtual, NONE, np.int64)
    if zero.tag == agreed:
        offer[zero.mine.start : zero.mine.stop] = OWN
    for h in holdings:
        found = h.usable(agreed)
        if found is not None:
            quality = COPY if not found[1] else ADVANCED
            for v in h.shards:
                offer[v] = max(offer[v], quality)
    return offer


def providers(table: np.ndarray) -> list[int]:
    """Per shard, from every rank's offers (world, virtual): the rank that sends it (-1: lost with both copies)."""
    best = table.max(axis=0)
    return [int(np.argmax(table[:, v] == best[v])) if best[v] > NONE else -1 for v in range(table.shape[1])]


EXACT, NEEDS_GRAD = 1, 2
"""How a rank's daemon copy offers a shard: of the agreed step, or of the step before (advanced by its gradient)."""


def daemon_offers(zero: VirtualZero, daemon: Holding | None, agreed: int) -> tuple[np.ndarray, np.ndarray]:
    """(offers, kinds) per virtual shard of a daemon copy: COPY or ADVANCED, EXACT or NEEDS_GRAD; NONE elsewhere."""
    offer, kind = np.full(zero.virtual, NONE, np.int64), np.zeros(zero.virtual, np.int64)
    if daemon is not None:
        tag = daemon.slots[0].tag
        exact = tag == agreed
        offer[daemon.shards.start : daemon.shards.stop] = COPY if exact else ADVANCED
        kind[daemon.shards.start : daemon.shards.stop] = EXACT if exact else NEEDS_GRAD
    return offer, kind


@dataclass(frozen=True)
class Reassembled:
    lost: list[int]
    """Virtual shards lost with both copies (then nothing changed: the caller must not go on with this state)."""
    from_copies: list[int]
    """Virtual shards rebuilt from a buddy copy (their carrier left)."""
    replayed: list[int]
    """Of those, the shards whose copy was of an earlier step, advanced by the gradients kept since."""
    from_daemon: list[int] = field(default_factory=list)
    """Of `from_copies`, the shards whose copy came from a worker daemon's memory (offered by a replacement rank)."""


def reassemble(zero: VirtualZero, holdings: list[Holding], group: ProcessGroup, agreed: int,
               daemon: Holding | None = None) -> Reassembled:
    """Rebuild every shard at step `agreed` over `group` and carry the new block (collective). `daemon`: this rank's
    copy in its worker daemon's memory (`DaemonCopy.holding`), offered where no survivor holds better."""
    offer = offers(zero, holdings, agreed)
    extra, kind = daemon_offers(zero, daemon, agreed)
    better = extra > offer  # a daemon copy is offered where this rank holds nothing better
    offer, kind = np.where(better, extra, offer), np.where(better, kind, 0)
    grad_tag = zero.grad_tag if zero.tag >= 0 else -1
    row = np.concatenate([offer, kind, np.array([grad_tag], np.int64)])
    gathered = np.asarray(group.all_gather(row)).reshape(group.size, 2 * zero.virtual + 1)
    table, kinds, grad_tags = gathered[:, : zero.virtual].copy(), gathered[:, zero.virtual : -1], gathered[:, -1]
    holders = [r for r in range(group.size) if grad_tags[r] == agreed]
    if not holders:  # nobody holds the agreed step's gradient: a daemon copy one step old cannot be advanced
        table[kinds == NEEDS_GRAD] = NONE
    source = providers(table)
    lost = [v for v, r in enumerate(source) if r < 0]
    copied = [v for v, r in enumerate(source) if r >= 0 and table[r, v] < OWN]
    replayed = [v for v in copied if table[source[v], v] == ADVANCED]
    from_daemon = [v for v in copied if kinds[source[v], v] != 0]
    if lost:
        return Reassembled(lost, copied, replayed, from_daemon)
    if any(kinds[source[v], v] == NEEDS_GRAD for v in copied):
        group.broadcast(zero.whole_grad(), src=holders[0])  # the agreed step's averaged gradient, to advance a copy by
    if daemon is not None and kinds[group.rank].any():
        if kinds[group.rank, daemon.shards.start] == NEEDS_GRAD:
            daemon.grads = {agreed: zero.whole_grad()[zero.span(daemon.shards)]}
        holdings = [daemon, *holdings]
    rows_shape, scalars_shape = zero.rows_shape(1)
    rows, scalars = np.empty(rows_shape[1:], zero.flat.dtype), np.empty(scalars_shape[1:], np.float64)
    like = dict(zero.optim.state[0])
    ready = {v: _advanced(zero, holdings, v, agreed) for v, r in enumerate(source) if r == group.rank}
    mine = carried(group.rank, group.size, zero.virtual)
    states = {}
    for v, r in enumerate(source):
        if r == group.rank:
            np.copyto(rows, ready[v][0])
            np.copyto(scalars, ready[v][1])
        group.broadcast(rows, src=r)
        group.broadcast(scalars, src=r)
        zero.flat[zero.span(range(v, v + 1))] = rows[0]
        if v in mine:
            states[v] = zero.unpack(rows, scalars, like)
    zero.place(group, states)
    zero.tag = agreed
    return Reassembled([], copied, replayed, from_daemon)


def _advanced(zero: VirtualZero, holdings: list[Holding], v: int, agreed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shard `v` at the agreed step as this rank offers it: packed from its own state, or from a buddy copy (advanced
    by the gradients kept since the copy's step)."""
    rows_shape, scalars_shape = zero.rows_shape(1)
    rows, scalars = np.empty(rows_shape[1:], zero.flat.dtype), np.empty(scalars_shape[1:], np.float64)
    if zero.tag == agreed and v in zero.mine:
        zero.pack(v, rows, scalars)
        return rows, scalars
    for h in holdings:
        found = h.usable(agreed) if v in h.shards else None
        if found is not None:
            slot, grads = found
            i = v - h.shards.start
            np.copyto(rows, slot.rows[i])
            np.copyto(scalars, slot.scalars[i])
            span = zero.shard
            zero.replay(rows, scalars, [g[i * span : (i + 1) * span] for g in grads])
            return rows, scalars
    raise AssertionError(f"shard {v} was offered but is not held")  # offers() and this agree by construction
