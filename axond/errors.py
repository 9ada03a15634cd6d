"""Exceptions raised by axond. Every distributed failure is a `DistributedError`."""

from __future__ import annotations

from collections.abc import Iterable


class AxondError(Exception):
    """Base class of every error axond raises on purpose."""


class DistributedError(AxondError):
    """A collective or point-to-point op failed: a peer died, timed out or called a different op.

    The message names the op, the group, this rank and the peer; the same fields are kept as
    attributes so that callers can act on them. `root_cause` is set when the failure started with
    another rank's own exception: "rank R failed: ExcType: message". `timed_out` is True when this rank's
    own deadline passed (a peer did not answer within the group's timeout).
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        group: str | None = None,
        rank: int | None = None,
        peer: int | None = None,
        root_cause: str | None = None,
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.group = group
        self.rank = rank
        self.peer = peer
        self.root_cause = root_cause
        self.timed_out = timed_out


class ReplicaDivergence(DistributedError):
    """The replicas of a data-parallel group hold different parameters (a silent fault: a flipped bit, a bad core).

    Raised on every rank by `DistributedTrainer(digest_every=...)` when no agreed checkpoint is left to roll back to.
    `ranks` are the group ranks whose parameter digest differs from the majority's, `hosts` their host names,
    `step` the optimizer step the digest was taken after; `peer` is the first of `ranks` (what the worker's error
    file blames).
    """

    def __init__(self, message: str, *, ranks: list[int], hosts: list[str], step: int, group: str | None = None,
                 rank: int | None = None) -> None:
        super().__init__(message, op="replica_digest", group=group, rank=rank, peer=ranks[0] if ranks else None)
        self.ranks = ranks
        self.hosts = hosts
        self.step = step


class MembershipChanged(DistributedError):
    """A live job re-forms without a failed node: this rank's collective was cut, and the job goes on in `generation`.

    Raised (under `axond worker --live-recovery`) by the in-flight or next collective of every surviving rank.
    `reason` says who left and why (the coordinator's words: the rank, its node, its exit code); `peer` is the rank
    this one lost first, if it lost one. Call `axond.reform()` to take this process's place in the new generation
    (`DistributedTrainer` does, and runs the cut step again).
    """

    def __init__(self, message: str, *, generation: int, previous_generation: int, reason: str,
                 op: str | None = None, group: str | None = None, rank: int | None = None,
                 peer: int | None = None) -> None:
        super().__init__(message, op=op, group=group, rank=rank, peer=peer)
        self.generation = generation
        self.previous_generation = previous_generation
        self.reason = reason


class BypassedBackwardError(AxondError, RuntimeError):
    """A backward pass went around DDP/FSDP (the inner model's `backward`), so its gradients were not reduced.

    Raised on the next optimizer step or wrapper forward; the message says which `backward` to call.
    """


class StoreError(AxondError):
    """A key-value store call failed (coordinator unreachable, bad argument)."""


class StoreTimeout(StoreError, TimeoutError):
    """A store wait (get with wait, wait for keys, barrier) ran out of time."""


class CoordinatorError(AxondError):
    """The coordinator refused or could not answer a control-plane request."""


class BackendUnavailable(AxondError):
    """A backend was asked for but cannot run here; the message says what to install."""


def rank_list(ranks: Iterable[int], most: int = 8) -> str:
    """Ranks as an error message names them, bounded however many there are: up to `most` as a list ("[1, 4, 7]");
    more as runs of consecutive ranks, at most `most` of them, and the count ("3-1999999 (1999997 ranks)")."""
    ordered = sorted(ranks)
    if len(ordered) <= most:
        return str(ordered)
    runs: list[list[int]] = []
    for r in ordered:
        if runs and r <= runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:most])
    if len(runs) > most:
        text += f", ... {len(runs) - most} more"
    return f"{text} ({len(ordered)} ranks)"
