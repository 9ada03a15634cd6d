"""A durable coordinator keeps an open round's joiners a row each and its past rounds a record each: a commit
writes only the joiners that changed and a past round once (O(1) per Join, not the whole job), and a restart
recovers a half-filled round and the past generations exactly."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from axond.coordinator.persistence import MemoryPersistence, Persistence, SqlitePersistence
from axond.coordinator.state.port import Changes, Snapshot
from axond.coordinator.persistence.etcd import codec
from axond.coordinator.persistence.tables import Tables
from axond.coordinator.state.machine import CoordinatorState
from axond.coordinator.state.errors import Unavailable
from axond.errors import CoordinatorError
from sqlite_reopen import sqlite_reopener

NODES = 400
"""Joiners of the half-filled round (it needs twice as many to freeze)."""


class CodecTables:
    """Commits as the etcd backing applies them: each `Changes` encoded, decoded, then applied to `Tables`."""

    durable = True

    def __init__(self) -> None:
        self.tables = Tables()

    def load(self) -> Snapshot:
        return self.tables.snapshot()

    def commit(self, changes: Changes) -> None:
        self.tables.apply(codec.decode(codec.encode(changes)))

    def close(self) -> None:
        pass


Reopen = Callable[[], Persistence]


@pytest.fixture(params=["sqlite", "memory", "etcd-codec"])
def backing(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Reopen]:
    if request.param != "sqlite":
        store: Persistence = MemoryPersistence() if request.param == "memory" else CodecTables()
        yield lambda: store
        return
    with sqlite_reopener(tmp_path / "state") as reopen:
        yield reopen


def _state(p: Persistence) -> CoordinatorState:
    return CoordinatorState(heartbeat_interval=1.0, dead_after_missed=5, settle_time=0.0, persistence=p)


def _joiners(s: CoordinatorState, job: str) -> list[tuple[str, str, int, int]]:
    return [(nid, j.order_key[0], j.order_key[1], j.nproc) for nid, j in s.jobs[job].round.joiners.items()]


def _fill(s: CoordinatorState, count: int, now: float) -> list[str]:
    ids = []
    for i in range(count):
        node = s.register_node(f"host-{i % 37}", 8, False, now)
        assert s.join("big", node.node_id, 1 + i % 4, 2 * NODES, 2 * NODES, 1, now) is None
        ids.append(node.node_id)
    return ids


def test_half_filled_round_survives_restart_exactly(backing: Reopen) -> None:
    now = time.monotonic()
    s = _state(backing())
    ids = _fill(s, NODES, now)
    s.leave_rendezvous("big", ids[5])  # a joiner that gave up, and one that left and came back (moves last)
    s.leave_rendezvous("big", ids[7])
    assert s.join("big", ids[7], 3, 2 * NODES, 2 * NODES, 1, now) is None
    assert s.join("big", ids[9], 4, 2 * NODES, 2 * NODES, 1, now) is None  # an update keeps its place
    expected = _joiners(s, "big")
    assert len(expected) == NODES - 1 and expected[-1][0] == ids[7] and expected[9][3] == 4
    generation, ranks = s.jobs["big"].generation, s.jobs["big"].round.joined_ranks

    s2 = _state(backing())
    assert _joiners(s2, "big") == expected
    rnd = s2.jobs["big"].round
    assert not rnd.frozen and s2.jobs["big"].generation == generation and rnd.joined_ranks == ranks
    # the restored round goes on: the rest join, it freezes with every joiner ranked (once the fence a restart
    # sets has passed)
    _fill(s2, NODES, now)
    last = s2.register_node("host-last", 8, False, now)
    s2.join("big", last.node_id, 1, 2 * NODES, 2 * NODES, 1, now)
    s2.tick(rnd.not_before)
    assert rnd.frozen
    s3 = _state(backing())
    assert s3.jobs["big"].round.frozen and len(s3.jobs["big"].round.members or []) == 2 * NODES


def test_a_join_commits_one_joiner_row_not_the_round(tmp_path: Path) -> None:
    """Batches as the server's group commit takes them: the first holds the new round's joiners, a later
    one only what changed; a joiner that left and came back within a batch rewrites the round (its order)."""
    now = time.monotonic()
    p = SqlitePersistence(tmp_path / "state")
    s = _state(p)
    s.commit_later(lambda: None)  # commit by hand, as the server's group commit does
    ids = _fill(s, NODES, now)
    first = s.take_changes()
    assert first.joiners["big"].reset and len(first.joiners["big"].rows) == NODES
    p.commit(first)
    _fill(s, 1, now)
    c = s.take_changes()
    assert not c.joiners["big"].reset and len(c.joiners["big"].rows) == 1
    assert "joiners" not in c.jobs["big"]["round"]
    p.commit(c)
    s.leave_rendezvous("big", ids[3])
    s.leave_rendezvous("big", ids[4])
    assert s.join("big", ids[4], 2, 2 * NODES, 2 * NODES, 1, now) is None
    moved = s.take_changes()
    assert moved.joiners["big"].reset and len(moved.joiners["big"].rows) == NODES
    p.commit(moved)
    expected = _joiners(s, "big")
    assert expected[-1][0] == ids[4] and ids[3] not in s.jobs["big"].round.joiners
    p.close()
    assert _joiners(_state(SqlitePersistence(tmp_path / "state")), "big") == expected


def test_state_from_before_joiner_rows_is_read_and_moved(tmp_path: Path) -> None:
    """An older state file (joiners inside the job record, no joiners table) opens, keeps its round, and its
    next commit moves the joiners into rows."""
    now = time.monotonic()
    state_dir = tmp_path / "state"
    p = SqlitePersistence(state_dir)
    s = _state(p)
    _fill(s, 50, now)
    expected = _joiners(s, "big")
    a, b = s.register_node("a", 0, False, now), s.register_node("b", 0, False, now)
    for n in (a, b):
        s.join("r", n.node_id, 1, 2, 2, 1, now)
    s.report_failure("r", b.node_id, 1, 1, 3, "boom", now)
    members = [(m.node_id, m.rank_offset) for m in s.jobs["r"].past_rounds[0].members or []]
    p.close()
    db = sqlite3.connect(state_dir / "coordinator.db")
    (record,) = db.execute("SELECT record FROM jobs WHERE name = 'big'").fetchone()
    old = json.loads(record)
    old["round"]["joiners"] = [list(j) for j in expected]
    old["past_rounds"] = old.pop("past_generations")
    db.execute("UPDATE jobs SET record = ? WHERE name = 'big'", (json.dumps(old),))
    (record,) = db.execute("SELECT record FROM jobs WHERE name = 'r'").fetchone()
    old = json.loads(record)
    del old["past_generations"]
    old["round"]["joiners"] = []
    old["past_rounds"] = [json.loads(rec) for (rec,) in db.execute("SELECT record FROM past_rounds")]
    db.execute("UPDATE jobs SET record = ? WHERE name = 'r'", (json.dumps(old),))
    db.execute("DROP TABLE joiners")
    db.execute("DROP TABLE past_rounds")
    db.execute("PRAGMA user_version = 0")
    db.commit()
    db.close()

    s2 = _state(SqlitePersistence(state_dir))
    assert _joiners(s2, "big") == expected
    assert [(m.node_id, m.rank_offset) for m in s2.jobs["r"].past_rounds[0].members or []] == members
    _fill(s2, 1, now)
    s2.join("r", a.node_id, 1, 2, 2, 1, now)
    s2.persistence.close()  # type: ignore[union-attr]
    s3 = _state(SqlitePersistence(state_dir))
    assert _joiners(s3, "big") == _joiners(s2, "big") and len(_joiners(s3, "big")) == 51
    assert [(m.node_id, m.rank_offset) for m in s3.jobs["r"].past_rounds[0].members or []] == members
    assert _joiners(s3, "r") == _joiners(s2, "r") and len(_joiners(s3, "r")) == 1


def test_state_from_a_newer_layout_is_refused(tmp_path: Path) -> None:
    SqlitePersistence(tmp_path).close()
    db = sqlite3.connect(tmp_path / "coordinator.db")
    db.execute("PRAGMA user_version = 99")
    db.commit()
    db.close()
    with pytest.raises(CoordinatorError, match="written by a newer axond"):
        SqlitePersistence(tmp_path)


class FailOnce:
    """SQLite whose next commit fails once when `fail` is set (a full disk, say)."""

    durable = True

    def __init__(self, inner: SqlitePersistence) -> None:
        self.inner, self.fail = inner, False

    def load(self) -> Snapshot:
        return self.inner.load()

    def commit(self, changes: Changes) -> None:
        if self.fail:
            self.fail = False
            raise OSError(28, "No space left on device")
        self.inner.commit(changes)

    def close(self) -> None:
        self.inner.close()


def test_joiner_whose_commit_failed_is_written_by_the_next(tmp_path: Path) -> None:
    """A Join answered UNAVAILABLE (its commit failed) stays in the round in memory; the next commit writes
    the round whole, so disk and memory agree again."""
    now = time.monotonic()
    p = FailOnce(SqlitePersistence(tmp_path / "state"))
    s = _state(p)
    _fill(s, 20, now)
    node = s.register_node("host-x", 8, False, now)
    p.fail = True
    with pytest.raises(Unavailable):
        s.join("big", node.node_id, 1, 2 * NODES, 2 * NODES, 1, now)
    _fill(s, 1, now)
    expected = _joiners(s, "big")
    assert node.node_id in s.jobs["big"].round.joiners and len(expected) == 22
    p.close()
    assert _joiners(_state(SqlitePersistence(tmp_path / "state")), "big") == expected


def test_past_rounds_written_once_and_restored(backing: Reopen) -> None:
    """Each generation's round is written once when it is archived (not with every commit of its job), the
    oldest are dropped as the job keeps four, and a restart recovers them (late Joins are answered from them)."""
    now = time.monotonic()
    s = _state(backing())
    nodes = [s.register_node(f"h{i}", 0, False, now) for i in range(30)]
    for gen in range(1, 7):
        for n in nodes:
            s.join("j", n.node_id, 2, 30, 30, 10, now)
        assert s.jobs["j"].round.frozen and s.jobs["j"].generation == gen
        s.report_failure("j", nodes[gen].node_id, gen, 1, 3, "boom", now)

    def generations(state: CoordinatorState) -> list[tuple[int, list[tuple[str, int]]]]:
        rounds = state.jobs["j"].past_rounds
        return [(p.generation, [(m.node_id, m.rank_offset) for m in p.members or []]) for p in rounds]

    past = generations(s)
    assert [g for g, _ in past] == [3, 4, 5, 6]
    if isinstance(s.persistence, SqlitePersistence):
        stored = s.persistence.load().past_rounds
        assert sorted(g for _, g, _ in stored) == [3, 4, 5, 6]
    r = _state(backing())
    assert generations(r) == past
    late = r.join_result("j", nodes[0].node_id, now, since=6)
    assert late is not None and late.generation == 6


def test_a_join_does_not_rewrite_past_rounds(tmp_path: Path) -> None:
    now = time.monotonic()
    s = _state(SqlitePersistence(tmp_path / "state"))
    s.commit_later(lambda: None)
    nodes = [s.register_node(f"h{i}", 0, False, now) for i in range(3)]
    for n in nodes:
        s.join("j", n.node_id, 1, 3, 3, 1, now)
    s.report_failure("j", nodes[2].node_id, 1, 1, 3, "boom", now)
    first = s.take_changes()
    assert list(first.past_rounds["j"]) == [1] and first.jobs["j"]["past_generations"] == [1]
    s.join("j", nodes[0].node_id, 1, 3, 3, 1, now)
    later = s.take_changes()
    assert "j" in later.jobs and "j" not in later.past_rounds and len(later.joiners["j"].rows) == 1


def test_etcd_snapshot_holds_joiner_rows_and_past_rounds() -> None:
    """etcd's snapshot (`codec.whole`, applied to empty tables) gives back the same joiners and past rounds."""
    now = time.monotonic()
    store = CodecTables()
    s = _state(store)
    nodes = [s.register_node(f"h{i}", 0, False, now) for i in range(3)]
    for n in nodes:
        s.join("j", n.node_id, 1, 3, 3, 1, now)
    s.report_failure("j", nodes[2].node_id, 1, 1, 3, "boom", now)
    _fill(s, 30, now)
    again = Tables()
    again.apply(codec.decode(codec.encode(codec.whole(store.tables))))
    assert again.snapshot() == store.tables.snapshot()
    r = _state(CodecTables())
    assert isinstance(r.persistence, CodecTables)
    r.persistence.tables = again
    restored = _state(r.persistence)
    assert _joiners(restored, "big") == _joiners(s, "big")
    assert [p.generation for p in restored.jobs["j"].past_rounds] == [1]
