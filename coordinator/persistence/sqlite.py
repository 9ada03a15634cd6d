"""State in SQLite (WAL) in the coordinator's state directory: each commit is one transaction.

With `synchronous=NORMAL` in WAL mode a committed transaction survives the process being killed
(`kill -9`: the WAL is in the OS's cache); `fsync=True` (`synchronous=FULL`) also survives a power
loss at the cost of one disk flush per commit (the server commits many calls at once: group_commit.py).
One coordinator at a time may use a state directory:
it holds an exclusive lock on `coordinator.lock` there.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sqlite3
from pathlib import Path
from typing import IO

from axond.coordinator.state.port import Changes, Snapshot
from axond.errors import CoordinatorError

DB_NAME = "coordinator.db"
LOCK_NAME = "coordinator.lock"

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (node_id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (name TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS kv (job TEXT, key TEXT, generation INTEGER NOT NULL, value BLOB NOT NULL,
                               PRIMARY KEY (job, key));
CREATE TABLE IF NOT EXISTS barriers (job TEXT, name TEXT, generation INTEGER NOT NULL, record TEXT NOT NULL,
                                     PRIMARY KEY (job, name));
CREATE TABLE IF NOT EXISTS events (job TEXT, idx INTEGER, record TEXT NOT NULL, PRIMARY KEY (job, idx));
CREATE TABLE IF NOT EXISTS meta (id INTEGER PRIMARY KEY CHECK (id = 0), record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS joiners (job TEXT, node_id TEXT, generation INTEGER NOT NULL, record TEXT NOT NULL,
                                    PRIMARY KEY (job, node_id));
CREATE TABLE IF NOT EXISTS past_rounds (job TEXT, generation INTEGER, record TEXT NOT NULL,
                                        PRIMARY KEY (job, generation));
"""
"""A state from before the joiners and past_rounds tables (its job records hold their rounds' joiners and
past rounds) gets the tables at open and is read as before; each job's next commit moves them there."""

SCHEMA_VERSION = 1
"""`PRAGMA user_version` of this layout (0: a state written before it was set, read the same way)."""


def _read_only(directory: Path, e: BaseException) -> str:
    return (f"the state directory {str(directory)!r} is read-only ({e}): the coordinator must write every change "
            "it acknowledges; make it writable, or pass another --state-dir (or --in-memory)")


def _corrupt(directory: Path, e: BaseException) -> str:
    return (f"the coordinator's state in {str(directory / DB_NAME)!r} is corrupt ({e}); restore it from a backup, "
            f"or move {DB_NAME} and its -wal and -shm files aside to start with an empty state")


def _check_writable(directory: Path) -> None:
    """Raise OSError unless a file can be created, written and removed in `directory`."""
    probe = directory / f".write-check-{os.getpid()}"
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)
        os.unlink(probe)


def _check_intact(db: sqlite3.Connection, directory: Path) -> None:
    """Raise CoordinatorError if SQLite's own check finds the database damaged."""
    problems = [row[0] for row in db.execute("PRAGMA quick_check(5)")]
    if problems != ["ok"]:
        raise CoordinatorError(_corrupt(directory, RuntimeError("; ".join(problems))))


class SqlitePersistence:
    """The `Persistence` contract in `<state_dir>/coordinator.db`."""

    durable = True

    def __init__(self, state_dir: str | os.PathLike[str], fsync: bool = False) -> None:
        self.directory = Path(state_dir)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._lock: IO[bytes] | None = open(self.directory / LOCK_NAME, "ab")
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise CoordinatorError(_read_only(self.directory, e)) from e
            raise CoordinatorError(f"cannot use the state directory {str(self.directory)!r}: {e.strerror}") from e
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self._lock.close()
            self._lock = None
            raise CoordinatorError(
                f"another coordinator uses the state directory {str(self.directory)!r}; stop it, or pass another "
                "--state-dir (or --in-memory)"
            ) from e
        try:
            _check_writable(self.directory)
            self._db = sqlite3.connect(self.directory / DB_NAME, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise CoordinatorError(
                    f"the coordinator's state in {str(self.directory / DB_NAME)!r} was written by a newer axond "
                    f"(schema {version}, this one reads up to {SCHEMA_VERSION}); run that version, or pass another "
                    "--state-dir")
            self._db.executescript(SCHEMA)
            if version < SCHEMA_VERSION:
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            _check_intact(self._db, self.directory)
            self._db.execute("BEGIN IMMEDIATE")  # the write lock: read-only fails here, not at the first commit
            self._db.execute("ROLLBACK")
            os.chmod(self.directory / DB_NAME, 0o600)
        except CoordinatorError:
            self.close()
            raise
        except sqlite3.DatabaseError as e:
            self.close()
            if "readonly" in str(e) or "read-only" in str(e):
                raise CoordinatorError(_read_only(self.directory, e)) from e
            raise CoordinatorError(_corrupt(self.directory, e)) from e
        except OSError as e:
            self.close()
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise CoordinatorError(_read_only(self.directory, e)) from e
            raise CoordinatorError(f"cannot open the coordinator's database in {str(self.directory)!r}: {e}") from e

    def load(self) -> Snapshot:
        db = self._db
        snap = Snapshot(
            nodes=[json.loads(r) for (r,) in db.execute("SELECT record FROM nodes")],
            jobs=[json.loads(r) for (r,) in db.execute("SELECT record FROM jobs")],
            kv=[(j, g, k, bytes(v)) for j, k, g, v in db.execute("SELECT job, key, generation, value FROM kv")],
            barriers=[(j, g, n, json.loads(r)) for j, n, g, r in db.execute("SELECT job, name, generation, record FROM barriers")],
        )
        for job, idx, record in db.execute("SELECT job, idx, record FROM events ORDER BY job, idx"):
            first, events = snap.events.setdefault(job, (idx, []))
            events.append(json.loads(record))
        snap.joiners = [(j, g, n, json.loads(r)) for j, g, n, r in
                        db.execute("SELECT job, generation, node_id, record FROM joiners ORDER BY rowid")]
        snap.past_rounds = [(j, g, json.loads(r)) for j, g, r in
                            db.execute("SELECT job, generation, record FROM past_rounds")]
        row = db.execute("SELECT record FROM meta WHERE id = 0").fetchone()
        snap.meta = json.loads(row[0]) if row else None
        return snap

    def commit(self, c: Changes) -> None:
        db = self._db

        def many(sql: str, rows: list[tuple[object, ...]]) -> None:
            if rows:
                db.executemany(sql, rows)

        try:
            db.execute("BEGIN IMMEDIATE")
            many("DELETE FROM nodes WHERE node_id = ?", [(n,) for n in c.deleted_nodes])
            many("INSERT OR REPLACE INTO nodes VALUES (?, ?)", [(n, json.dumps(r)) for n, r in c.nodes.items()])
            for job in c.deleted_jobs | c.cleared_stores:
                db.execute("DELETE FROM kv WHERE job = ?", (job,))
                db.execute("DELETE FROM barriers WHERE job = ?", (job,))
            for job in c.deleted_jobs:
                db.execute("DELETE FROM jobs WHERE name = ?", (job,))
                db.execute("DELETE FROM events WHERE job = ?", (job,))
                db.execute("DELETE FROM joiners WHERE job = ?", (job,))
                db.execute("DELETE FROM past_rounds WHERE job = ?", (job,))
            many("INSERT OR REPLACE INTO jobs VALUES (?, ?)", [(n, json.dumps(r)) for n, r in c.jobs.items()])
            for job, rounds in c.past_rounds.items():
                many("DELETE FROM past_rounds WHERE job = ? AND generation = ?",
                     [(job, g) for g, rec in rounds.items() if rec is None])
                many("INSERT OR REPLACE INTO past_rounds VALUES (?, ?, ?)",
                     [(job, g, json.dumps(rec)) for g, rec in rounds.items() if rec is not None])
            for job, jc in c.joiners.items():
                if jc.reset:
                    db.execute("DELETE FROM joiners WHERE job = ?", (job,))
                many("DELETE FROM joiners WHERE job = ? AND node_id = ?",
                     [(job, n) for n, row in jc.rows.items() if row is None])
                many("INSERT INTO joiners VALUES (?, ?, ?, ?) ON CONFLICT (job, node_id) DO UPDATE "
                     "SET generation = excluded.generation, record = excluded.record",  # keeps its place (rowid)
                     [(job, n, jc.generation, json.dumps(row)) for n, row in jc.rows.items() if row is not None])
            many("DELETE FROM kv WHERE job = ? AND key = ?", [k for k, (_, v) in c.kv.items() if v is None])
            many("INSERT OR REPLACE INTO kv VALUES (?, ?, ?, ?)",
                 [(j, k, g, v) for (j, k), (g, v) in c.kv.items() if v is not None])
            many("INSERT OR REPLACE INTO barriers VALUES (?, ?, ?, ?)",
                 [(j, n, g, json.dumps(r)) for (j, n), (g, r) in c.barriers.items()])
            for job, (first, events) in c.events.items():
                many("INSERT OR REPLACE INTO events VALUES (?, ?, ?)",
                     [(job, first + i, json.dumps(e)) for i, e in enumerate(events)])
                base = c.jobs.get(job, {}).get("events_base")
                if base is not None:
                    db.execute("DELETE FROM events WHERE job = ? AND idx < ?", (job, base))
            if c.meta is not None:
                db.execute("INSERT OR REPLACE INTO meta VALUES (0, ?)", (json.dumps(c.meta),))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            db.close()
            self._db = None  # type: ignore[assignment]
        if self._lock is not None:
            self._lock.close()
            self._lock = None
