"""Stacks on demand: `axond status --job J --stacks` asks, every worker of the job answers for its local ranks.

The asker puts a request (`REQUEST_KEY`, JSON with a fresh id) in the job generation's coordinator store; each worker
reads it at most every `POLL_S` while its ranks run, and for every local rank puts the rank's Python stacks (every
thread, `axond.worker.stacks.rank_stacks`: the rank's faulthandler on a signal) or why there are none (stopped,
exited) under `REPLY_KEY.format(rank)`, tagged with the request's id. The asker waits for the replies of the ranks it
asked about until its deadline. So the stacks of every node reach the asker through the coordinator, and nothing
but the job's own store is written: nothing the asker can make a worker keep or do beyond one answer per request.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from axond.store import Store

REQUEST_KEY = "axond/stacks/request"
REPLY_KEY = "axond/stacks/{}"
POLL_S = 0.5
"""Seconds between two reads of the request by a worker (at least)."""
MAX_TEXT = 64 * 1024
"""Characters of one rank's reply kept (the worker reads 64 KiB of stacks at most)."""
MAX_DUMP = 256 * 1024
"""Bytes of a rank's Flight Recorder dump sent at most (`flight_recorder`: a few hundred bytes per group)."""


@dataclass(frozen=True)
class StackReply:
    """What a rank's worker answered: its node's host, the rank's pid (0: none) and its stacks or why none, and its
    Flight Recorder dump (b"" if none came)."""

    rank: int
    host: str
    pid: int
    text: str
    dump: bytes = b""


def ask(store: Store) -> str:
    """Put a new request; returns its id."""
    ident = secrets.token_hex(8)
    store.set(REQUEST_KEY, json.dumps({"id": ident, "at": time.time()}).encode())
    return ident


def pending(store: Store, answered: str) -> str | None:
    """The id of the request in `store` if it is not `answered` (None: none, or already answered)."""
    raw = store.try_get(REQUEST_KEY)
    if raw is None:
        return None
    try:
        ident = json.loads(raw).get("id")
    except (ValueError, AttributeError):
        return None
    return ident if isinstance(ident, str) and ident and ident != answered else None


def answer(store: Store, ident: str, rank: int, host: str, pid: int, text: str, dump: bytes = b"") -> None:
    """Put rank `rank`'s reply to request `ident`."""
    fr = base64.b64encode(dump).decode() if 0 < len(dump) <= MAX_DUMP else ""
    body = {"id": ident, "host": host, "pid": pid, "text": text[:MAX_TEXT], "fr": fr}
    store.set(REPLY_KEY.format(rank), json.dumps(body).encode())


def collect(store: Store, ident: str, ranks: Sequence[int], deadline_s: float,
            clock: Callable[[], float] = time.monotonic, pause: float = 0.1) -> dict[int, StackReply]:
    """The replies to `ident` of `ranks` that came by `deadline_s` seconds from now (the others left out)."""
    end = clock() + deadline_s
    got: dict[int, StackReply] = {}
    while True:
        for rank in ranks:
            if rank in got:
                continue
            reply = _reply(store.try_get(REPLY_KEY.format(rank)), ident, rank)
            if reply is not None:
                got[rank] = reply
        if len(got) == len(ranks) or clock() >= end:
            return got
        time.sleep(pause)


def _reply(raw: bytes | None, ident: str, rank: int) -> StackReply | None:
    if raw is None:
        return None
    try:
        data: Any = json.loads(raw)
        if data.get("id") != ident:
            return None
        dump = base64.b64decode(str(data.get("fr", "")), validate=True)
        return StackReply(rank, str(data.get("host", "")), int(data.get("pid", 0)), str(data.get("text", "")), dump)
    except (ValueError, TypeError, AttributeError, binascii.Error):
        return None
