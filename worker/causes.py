"""What the agent reads to name a failure's root cause and what waiting ranks wait for.

A survivor's `DistributedError` names the rank whose failure it saw (`rank R failed: ...`); when that rank runs
on another node, this node's failure is a consequence, and the other node's report is the job's reason. Ranks
using axond's native API publish what they are blocked in to the generation's coordinator store
(`axond.distributed.diagnostics.inflight`); the agent reads those reports for its "still waiting" notices.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from axond.distributed.diagnostics.inflight import Blocked, read_report
from axond.errors import CoordinatorError, StoreError
from axond.worker.launcher import RankExit

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient
    from axond.worker.agent import JobOutcome

_PEER_FAILED = re.compile(r"\brank (\d+) failed: ")
"""How a survivor's DistributedError names the rank whose failure it saw (`axond.distributed.diagnostics.failure`)."""


def caused_elsewhere(failure: RankExit, local: Sequence[int]) -> bool:
    """Whether `failure` says it is the consequence of a rank that is not one of this node's `local` ranks."""
    found = _PEER_FAILED.search(failure.message)
    return found is not None and int(found.group(1)) not in local


@dataclass(frozen=True)
class Elsewhere:
    """The job moved on because of another node's report: this node's outcome (None: re-join)."""

    outcome: JobOutcome | None


def blocked_reader(client: CoordinatorClient, job: str, generation: int
                   ) -> Callable[[Sequence[int]], dict[int, Blocked] | None]:
    """Reads what ranks report being blocked in, from the generation's coordinator store; None when the store
    cannot be read (the generation ended, the coordinator is away)."""
    store = client.store(job, generation)

    def read(ranks: Sequence[int]) -> dict[int, Blocked] | None:
        out: dict[int, Blocked] = {}
        for rank in ranks:
            try:
                out[rank] = read_report(store, rank)[0]
            except ValueError:
                out[rank] = []
            except (CoordinatorError, StoreError):
                return None
        return out

    return read
