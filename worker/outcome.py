"""How one node's part in a job ends (`JobOutcome`), the exit codes that say why, and the agent's notices."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from axond.v1 import coordinator_pb2 as pb

Notice = Callable[[str], None]
"""Receives a one-line notice about the agent's progress (joins, restarts, failures)."""

JOB_FAILED_ELSEWHERE_EXIT_CODE = 1
"""Exit code of a node whose own ranks were fine when the job failed because of another node."""

TERMINAL_STATES = (pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED, pb.JOB_STATE_SUCCEEDED)
LEASE_LOST_EXIT_CODE = 3
"""Exit code of a node that lost contact with the coordinator for a whole lease while running (its ranks
were stopped): the same code as a coordinator that cannot be reached at start."""


def notice_to_stderr(prefix: str) -> Notice:
    """A `Notice` printing `prefix: text` lines on stderr."""

    def notice(text: str) -> None:
        sys.stderr.write(f"{prefix}: {text}\n")
        sys.stderr.flush()

    return notice


stderr_notice = notice_to_stderr("axond worker")
"""The agent's notices: `axond worker: text` on stderr."""


@dataclass(frozen=True)
class JobOutcome:
    """How this node's part of a job ended."""

    exit_code: int
    """0 if every local rank of the last generation exited 0."""
    message: str = ""
    """Why it failed (names the failing rank), empty on success."""
    error: Exception | None = None
    """The control-plane error that ended the job for this node, if that is what ended it."""
    lease_lost: bool = False
    """The node lost contact with the coordinator for a whole lease and stopped its ranks."""
    refused: bool = False
    """The coordinator refused this node's first Join (the job runs with other options or all its nodes)."""
