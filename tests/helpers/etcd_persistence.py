"""`EtcdPersistence` for tests: each `reopen()` ends the previous leader term and starts a new one, as a
coordinator replica does when it takes over (the state is read back with `load()`)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator

from axond.coordinator.persistence import Persistence
from axond.coordinator.persistence.etcd import EtcdPersistence, LeaderElection, Term
from etcd_cluster import EtcdServer


def lead(election: LeaderElection, attempts: int = 50) -> Term:
    """Win the election (the leader key is free: the previous term resigned)."""
    for _ in range(attempts):
        term = election.try_lead()
        if term is not None:
            return term
    raise AssertionError(f"no leadership after {attempts} attempts; leader is {election.leader_hint}")


@contextlib.contextmanager
def etcd_reopener(server: EtcdServer, prefix: str | None = None) -> Iterator[Callable[[], Persistence]]:
    prefix = prefix or f"/axond-test-{uuid.uuid4().hex[:8]}"
    client = server.client()
    election = LeaderElection(client, prefix, "127.0.0.1:1", ttl=5)
    terms: list[Term] = []

    def reopen() -> Persistence:
        for term in terms:
            if not term.ended.is_set():
                election.resign(term)
        terms.append(lead(election))
        return EtcdPersistence(client, prefix, terms[-1])

    try:
        yield reopen
    finally:
        for term in terms:
            election.resign(term)
        client.close()
