"""The coordinator's state in etcd: a log of commits plus a snapshot, every write guarded by leadership.

Keys under the prefix P (see docs/design/etcd-state.md):
- `P/log/<seq>`: one commit (`codec.encode` of its `Changes`), written by one Txn; a commit larger than
  `CHUNK_BYTES` is first written as `P/part/<seq>/<i>` pieces, then its `P/log/<seq>` head names them.
- `P/snap/<seq>/<i>`: the pieces of a snapshot holding every commit up to `seq`; `P/snapshot` points
  at the newest one. Writing the pointer, deleting the log entries it covers and the older
  snapshots is one Txn, so a reader sees the old snapshot and its log, or the new one and its log.
Every Txn compares the leader key's create revision with this term's (`Term.guard`): a replica that
is no longer the leader writes nothing, and its commit raises `NotLeader`.
"""

from __future__ import annotations

import logging

from axond.coordinator.state.port import Changes, Snapshot
from axond.coordinator.persistence.etcd import codec
from axond.coordinator.persistence.etcd.client import (EtcdClient, EtcdError, KeyValue, RequestOp, delete_op, prefix_end,
                                                      put_op)
from axond.coordinator.persistence.etcd.election import Term
from axond.coordinator.persistence.tables import Tables

log = logging.getLogger("axond.coordinator")

CHUNK_BYTES = 1 << 20
"""Largest value one Txn writes (etcd refuses requests over 1.5 MiB by default, --max-request-bytes)."""
SNAPSHOT_EVERY = 1000
"""Log entries (commits) after which the leader writes a snapshot and drops them."""
SNAPSHOT_BYTES = 32 << 20
"""Log bytes after which the leader writes a snapshot even before SNAPSHOT_EVERY entries."""
INLINE = b"J"
PIECES = b"P"


class NotLeader(EtcdError):
    """A guarded write found that this replica no longer leads: it must stop serving."""


def _seq(n: int) -> bytes:
    return b"%020d" % n


class EtcdPersistence:
    """The `Persistence` contract on etcd, for the leader of one term."""

    durable = True

    def __init__(self, client: EtcdClient, prefix: str, term: Term) -> None:
        self._client = client
        self._term = term
        p = prefix.rstrip("/").encode()
        self._log, self._part, self._snap, self._pointer = p + b"/log/", p + b"/part/", p + b"/snap/", p + b"/snapshot"
        self._tables = Tables()
        self._next = 1
        """Sequence number of the next commit."""
        self._log_entries = 0
        self._log_bytes = 0
        self._snapshot_revision = 0
        """etcd revision at which the current snapshot was written (history before it may be compacted)."""

    def load(self) -> Snapshot:
        """Read the snapshot and the log after it at one revision; later commits continue the log."""
        tables = Tables()
        pointer, revision = self._client.range(self._pointer, self._pointer + b"\0")
        upto = 0
        if pointer:
            upto, pieces = (int(x) for x in pointer[0].value.split(b","))
            base = self._snap + _seq(upto) + b"/"
            tables.apply(codec.decode(self._pieces(base, pieces, revision)))
        entries, _ = self._client.range(self._log + _seq(upto + 1), prefix_end(self._log), revision)
        self._log_entries, self._log_bytes = len(entries), 0
        for kv in entries:
            seq = int(kv.key[len(self._log):])
            blob = self._entry(seq, kv, revision)
            tables.apply(codec.decode(blob))
            self._log_bytes += len(blob)
            upto = seq
        self._tables, self._next = tables, upto + 1
        return tables.snapshot()

    def _entry(self, seq: int, kv: KeyValue, revision: int) -> bytes:
        kind, body = kv.value[:1], kv.value[1:]
        if kind == INLINE:
            return body
        return self._pieces(self._part + _seq(seq) + b"/", int(body), revision)

    def _pieces(self, base: bytes, count: int, revision: int) -> bytes:
        found, _ = self._client.range(base, prefix_end(base), revision)
        if len(found) != count:
            raise EtcdError(f"etcd state under {base.decode()!r} has {len(found)} pieces, its head says {count}")
        return b"".join(kv.value for kv in found)

    def commit(self, changes: Changes) -> None:
        blob = codec.encode(changes)
        seq = self._next
        if len(blob) <= CHUNK_BYTES:
            self._guarded(f"commit {seq}", put_op(self._log + _seq(seq), INLINE + blob))
        else:
            base = self._part + _seq(seq) + b"/"
            self._guarded(f"commit {seq}", delete_op(base, prefix_end(base)))
            count = self._write_pieces(base, blob, f"commit {seq}")
            self._guarded(f"commit {seq}", put_op(self._log + _seq(seq), PIECES + b"%d" % count))
        self._tables.apply(changes)
        self._next = seq + 1
        self._log_entries += 1
        self._log_bytes += len(blob)
        if self._log_entries >= SNAPSHOT_EVERY or self._log_bytes >= SNAPSHOT_BYTES:
            self.write_snapshot()

    def write_snapshot(self) -> None:
        """Write every commit so far as one snapshot and drop the log entries it holds."""
        upto = self._next - 1
        blob = codec.encode(codec.whole(self._tables))
        base = self._snap + _seq(upto) + b"/"
        count = self._write_pieces(base, blob, "snapshot")
        reply = self._guarded(
            "snapshot",
            put_op(self._pointer, b"%d,%d" % (upto, count)),
            delete_op(self._log, self._log + _seq(upto + 1)),
            delete_op(self._part, self._part + _seq(upto + 1)),
            delete_op(self._snap, self._snap + _seq(upto)),
        )
        self._log_entries = self._log_bytes = 0
        previous, self._snapshot_revision = self._snapshot_revision, reply
        if previous:
            try:
                self._client.compact(previous)
            except EtcdError as e:
                log.info("etcd compaction to revision %d skipped: %s", previous, e)

    def _write_pieces(self, base: bytes, blob: bytes, what: str) -> int:
        pieces = [blob[i:i + CHUNK_BYTES] for i in range(0, len(blob), CHUNK_BYTES)] or [b""]
        for i, piece in enumerate(pieces):
            self._guarded(what, put_op(base + b"%06d" % i, piece))
        return len(pieces)

    def _guarded(self, what: str, *ops: RequestOp) -> int:
        """One Txn of `ops` if this term still leads; returns its revision, raises NotLeader otherwise."""
        reply = self._client.txn([self._term.guard()], ops)
        if not reply.succeeded:
            raise NotLeader(
                f"etcd refused {what}: this coordinator replica ({self._term.address}) is no longer the leader "
                "(its lease expired or another replica took over); it stops serving"
            )
        return int(reply.header.revision)

    def close(self) -> None:
        """Nothing to release: the etcd client belongs to the replica."""
