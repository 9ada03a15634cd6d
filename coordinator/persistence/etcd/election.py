"""Leader election among coordinator replicas through an etcd lease.

The leader key `P/leader` holds the leader's client address and is attached to its lease: it exists
only while the leader keeps the lease alive. A replica wins by creating the key (a Txn that succeeds
only if the key does not exist); its term is identified by the key's create revision, which every
write of the term compares (`Term.guard`), so a replica that lost the key writes nothing.

The leader renews the lease every TTL/3. It knows the lease lives at least until `sent + TTL` of the
last renewal etcd acknowledged (etcd counts from when it received it, which is later), so it serves
only until then minus `SAFETY_MARGIN_S`: by the time another replica can win, it has stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from axond.coordinator.persistence.etcd.client import Compare, EtcdClient, EtcdError, created_at, put_op, range_op

log = logging.getLogger("axond.coordinator")

SAFETY_MARGIN_S = 0.5
"""The leader stops this long before the earliest moment etcd may expire its lease."""
MIN_TTL_S = 2
"""etcd grants no lease shorter than this (with its default election timeout)."""


@dataclass
class Term:
    """One replica's leadership, from winning the leader key until its lease ends."""

    address: str
    """The client address the leader advertises."""
    key: bytes
    revision: int
    """Create revision of the leader key: unique to this term."""
    lease: int
    ttl: int
    valid_until: float
    """Monotonic time until which the lease surely lives (moved on by every renewal)."""
    ended: threading.Event = field(default_factory=threading.Event)
    """Set when the term is over (lost or resigned)."""
    on_lost: Callable[[], object] = field(default=lambda: None)
    """Called once, from the renewal thread, when the lease is lost."""

    def guard(self) -> Compare:
        """The compare every write of this term carries: the leader key is still the one this term created."""
        return created_at(self.key, self.revision)

    def leads(self) -> bool:
        return not self.ended.is_set() and time.monotonic() < self.valid_until


class LeaderElection:
    """Campaign for, hold and give up the leadership of the replicas sharing one etcd key prefix."""

    def __init__(self, client: EtcdClient, prefix: str, address: str, ttl: int = 3) -> None:
        if ttl < MIN_TTL_S:
            raise EtcdError(f"leader lease TTL {ttl} s is below etcd's minimum of {MIN_TTL_S} s")
        self._client = client
        self.key = prefix.rstrip("/").encode() + b"/leader"
        self.address = address
        """This replica's client address (the leader key's value while it leads)."""
        self.ttl = ttl
        self.leader_hint: str | None = None
        """The leader's address as last seen (None: no leader seen)."""

    def leader(self) -> str | None:
        """The current leader's address (None: no leader now)."""
        kv = self._client.get(self.key)
        self.leader_hint = kv.value.decode() if kv is not None else None
        return self.leader_hint

    def try_lead(self) -> Term | None:
        """One attempt: if there is no leader, become it (returns the term, renewed from now on); else None."""
        if self.leader() is not None:
            return None
        lease, ttl = self._client.grant(self.ttl)
        sent = time.monotonic()
        reply = self._client.txn([created_at(self.key, 0)], [put_op(self.key, self.address.encode(), lease)],
                                 [range_op(self.key)])
        if not reply.succeeded:
            kvs = reply.responses[0].response_range.kvs if reply.responses else []
            self.leader_hint = kvs[0].value.decode() if kvs else None
            self._revoke(lease)
            return None
        term = Term(self.address, self.key, int(reply.header.revision), lease, ttl, sent + ttl - SAFETY_MARGIN_S)
        self.leader_hint = self.address
        threading.Thread(target=self._renew, args=(term,), name="axond-leader-lease", daemon=True).start()
        log.info("this replica (%s) leads from etcd revision %d", self.address, term.revision)
        return term

    def _renew(self, term: Term) -> None:
        period = term.ttl / 3
        while not term.ended.is_set():
            wait = min(period, max(0.0, term.valid_until - time.monotonic()))
            if term.ended.wait(wait):
                return
            if time.monotonic() >= term.valid_until:
                break
            sent = time.monotonic()
            try:
                left = self._client.keep_alive(term.lease, timeout=max(0.1, min(period, term.valid_until - sent)))
            except EtcdError as e:
                log.warning("cannot renew the leader lease (%s); leading until it may expire", e)
                continue
            if left <= 0:
                break
            term.valid_until = sent + left - SAFETY_MARGIN_S
        if not term.ended.is_set():
            term.ended.set()
            log.error("this replica (%s) lost the leadership (its etcd lease ended); it stops serving", self.address)
            term.on_lost()

    def resign(self, term: Term) -> None:
        """End `term` now and free the leader key, so another replica takes over at once."""
        term.ended.set()
        self._revoke(term.lease)

    def _revoke(self, lease: int) -> None:
        try:
            self._client.revoke(lease)
        except EtcdError as e:
            log.info("could not revoke lease %x (%s); it expires by itself", lease, e)
