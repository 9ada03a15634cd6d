"""How the harness reports ranks: `RankFailed`, raised for the earliest failing rank or the ranks still running."""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence
from typing import Any, NamedTuple

from axond.errors import AxondError, rank_list


class RankFailed(AxondError):
    """A rank started by `run_threads`/`run_processes` failed or did not finish in time."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class Failure(NamedTuple):
    """One rank's failure: the earliest of several is reported (the others are usually its consequences)."""

    when: float
    rank: int
    what: Any
    """What failed, as the message shows it (the exception, its repr from another process, an exit code)."""
    traceback: str
    cause: BaseException | None = None
    """The exception itself when it was raised in this process (chained to `RankFailed`)."""

    @classmethod
    def caught(cls, rank: int, error: BaseException) -> Failure:
        """The exception being handled in this thread, timed now (monotonic clock)."""
        return cls(time.monotonic(), rank, error, traceback.format_exc(), error)


def raise_earliest(failures: Sequence[Failure], world_size: int) -> None:
    """Raise `RankFailed` for the earliest of `failures` (its traceback in the message); nothing if there are none."""
    if not failures:
        return
    first = min(failures, key=lambda f: f.when)
    raise RankFailed(f"rank {first.rank} of {world_size} failed: {first.what}\n{first.traceback}",
                     first.rank) from first.cause


def not_finished(stuck: Sequence[int], world_size: int, timeout: float) -> RankFailed:
    """The error for ranks `stuck` still running after `timeout` seconds."""
    return RankFailed(f"ranks {rank_list(stuck)} of {world_size} did not finish within {timeout:.1f} s", stuck[0])
