"""The worker's side of stacks on demand (`axond status --job J --stacks`): it answers for its local ranks.

On each monitor tick `StackAnswers.check` looks for a new request in the job generation's coordinator store, at most
every `POLL_S`, on a thread of its own (`Background`: the monitor loop never waits on the coordinator or on a rank's
stacks), and puts each local rank's stacks, or why there are none, as the reply
(`axond.distributed.diagnostics.stack_requests`), with the rank's Flight Recorder dump: it touches each rank's
request file first, and sends the dumps written by the time the stacks are gathered, or within `DUMP_WAIT_S`
(`axond.distributed.diagnostics.flight_recorder`).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from axond.distributed.diagnostics.flight_recorder import DUMP_SUFFIX, REQUEST_SUFFIX
from axond.distributed.diagnostics.stack_requests import MAX_DUMP, POLL_S, answer, pending
from axond.errors import CoordinatorError, StoreError
from axond.worker.background import Background

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient


DUMP_WAIT_S = 2.0
"""Longest the worker waits for its ranks' dumps (their reporter threads look at least once a second)."""


def _ask_dump(error_file: str) -> int:
    """Touch the rank's dump request; the time it was touched (ns), 0 if it could not be."""
    path = Path(error_file + REQUEST_SUFFIX)
    try:
        path.write_bytes(b"")
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _dump(error_file: str, asked: int, deadline: float) -> bytes:
    """The rank's dump once written after `asked` (ns), waiting until `deadline` (time.monotonic()); b"" if none."""
    path = error_file + DUMP_SUFFIX
    while True:
        try:
            if asked and os.stat(path).st_mtime_ns >= asked:
                with open(path, "rb") as f:
                    return f.read(MAX_DUMP + 1)
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return b""
        time.sleep(0.05)


class StackAnswers:
    """Answers the stack requests of one job generation for the local ranks `local`."""

    def __init__(self, client: CoordinatorClient, job: str, generation: int, local: Sequence[int],
                 stacks: Callable[[int], tuple[int, str]], error_file: Callable[[int], str],
                 every: float = POLL_S) -> None:
        """`stacks(rank)`: (pid or 0, the rank's stacks or why there are none); `error_file(rank)`: its error file."""
        self._client, self._job, self._gen = client, job, generation
        self._local, self._stacks, self._every = list(local), stacks, every
        self._error_file = error_file
        self._answered = ""
        self._next = 0.0
        self._host = socket.gethostname()
        self._bg: Background[bool] = Background(self._serve, "axond-stack-answers")

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self._every
        self._bg(self._local)

    def close(self, wait: float) -> bool:
        """Answer no more requests; wait up to `wait` seconds for an answer in progress (`Background.close`)."""
        return self._bg.close(wait)

    def _serve(self, ranks: Sequence[int]) -> bool:
        """Answer the pending request, if any; False when the store cannot be read."""
        try:
            store = self._client.store(self._job, self._gen)
            ident = pending(store, self._answered)
            if ident is None:
                return True
            asked = {rank: _ask_dump(self._error_file(rank)) for rank in ranks}
            replies = {rank: self._stacks(rank) for rank in ranks}
            deadline = time.monotonic() + DUMP_WAIT_S
            for rank, (pid, text) in replies.items():
                dump = _dump(self._error_file(rank), asked[rank], deadline) if pid else b""
                answer(store, ident, rank, self._host, pid, text, dump)
            self._answered = ident
        except (CoordinatorError, StoreError, ValueError):  # ValueError: the client was closed (the generation ended)
            return False
        return True
