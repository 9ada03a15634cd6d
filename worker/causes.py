"""What the agent reads to tell what waiting ranks wait for, and how it defers to another node's report.

Which local failure is the root cause is `axond.worker.blame`'s; when it names a rank on another node, this node's
failure is a consequence, and the other node's report is the job's reason (`Elsewhere`). Ranks publish what they
are blocked in to the generation's coordinator store (`axond.distributed.diagnostics.inflight`); the agent reads
those reports for its "still waiting" notices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from axond.distributed.diagnostics.inflight import Blocked, read_report
from axond.errors import CoordinatorError, StoreError

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient
    from axond.worker.agent import JobOutcome


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
