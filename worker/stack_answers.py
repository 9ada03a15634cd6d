"""The worker's side of stacks on demand (`axond status --job J --stacks`): it answers for its local ranks.

On each monitor tick `StackAnswers.check` looks for a new request in the job generation's coordinator store, at most
every `POLL_S`, on a thread of its own (`Background`: the monitor loop never waits on the coordinator or on a rank's
stacks), and puts each local rank's stacks, or why there are none, as the reply
(`axond.distributed.diagnostics.stack_requests`).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from axond.distributed.diagnostics.stack_requests import POLL_S, answer, pending
from axond.errors import CoordinatorError, StoreError
from axond.worker.background import Background

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient


class StackAnswers:
    """Answers the stack requests of one job generation for the local ranks `local`."""

    def __init__(self, client: CoordinatorClient, job: str, generation: int, local: Sequence[int],
                 stacks: Callable[[int], tuple[int, str]], every: float = POLL_S) -> None:
        """`stacks(rank)`: (pid or 0, the rank's stacks or why there are none)."""
        self._client, self._job, self._gen = client, job, generation
        self._local, self._stacks, self._every = list(local), stacks, every
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

    def _serve(self, ranks: Sequence[int]) -> bool:
        """Answer the pending request, if any; False when the store cannot be read."""
        try:
            store = self._client.store(self._job, self._gen)
            ident = pending(store, self._answered)
            if ident is None:
                return True
            for rank in ranks:
                pid, text = self._stacks(rank)
                answer(store, ident, rank, self._host, pid, text)
            self._answered = ident
        except (CoordinatorError, StoreError):
            return False
        return True
