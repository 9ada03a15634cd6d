"""axond's failures as the exceptions torch code catches.

torch users and torchelastic catch `RuntimeError` / `torch.distributed.DistBackendError` (torch 2.13 has no
timeout subclass of it); axond users catch `axond.DistributedError`. What the "axond" backend raises to torch code
is both: `TorchDistributedError`, and its subclass `TorchTimeoutError` when this rank's own deadline passed. A
timeout's message starts with gloo's wording ("Timed out waiting 5000ms for barrier operation to complete", after
a "[axond]" tag, as gloo's carries its source location), then axond's own (op, group, rank, the peer and what it
was doing).
"""

from __future__ import annotations

import torch.distributed as dist

from axond.errors import DistributedError, MembershipChanged


class TorchDistributedError(DistributedError, dist.DistBackendError):
    """A collective or point-to-point op of the "axond" torch backend failed: a `DistributedError` (op, group,
    rank, peer, root cause) that is also torch's `DistBackendError` (a `RuntimeError`)."""


class TorchTimeoutError(TorchDistributedError):
    """A `TorchDistributedError` because this rank's deadline passed (`timed_out` is True)."""


class TorchMembershipChanged(MembershipChanged, TorchDistributedError):
    """`axond.MembershipChanged` (a live job re-forms without a failed node) as the "axond" backend raises it to torch
    code: also a `TorchDistributedError`, so torch's wrappers and `except RuntimeError` see what they always saw, and
    `isinstance(e, axond.MembershipChanged)` tells a live re-formation (`generation`, `reason`) from a failure."""


def torch_wording(op: str, seconds: float) -> str:
    """The start of a timeout's message, in gloo's words (torch's tests and users' log filters look for it)."""
    return f"[axond] Timed out waiting {round(seconds * 1000)}ms for {op} operation to complete"


def for_torch(error: BaseException, timeout: float | None = None) -> BaseException:
    """`error` as torch code should see it: a `DistributedError` becomes a `TorchDistributedError` (a timeout a
    `TorchTimeoutError`, its message led by `torch_wording` with the group's `timeout` in seconds) keeping its
    fields and traceback (`MembershipChanged` a `TorchMembershipChanged`); anything else (a bad argument's ValueError
    or TypeError) is returned as it is."""
    if isinstance(error, TorchDistributedError) or not isinstance(error, DistributedError):
        return error
    if isinstance(error, MembershipChanged):
        words = str(error).replace("call axond.reform()", "re-form torch's group (axond.torch.live.Manager does)")
        changed = TorchMembershipChanged(words, generation=error.generation,
                                         previous_generation=error.previous_generation, reason=error.reason,
                                         op=error.op, group=error.group, rank=error.rank, peer=error.peer)
        changed.__cause__ = error.__cause__
        changed.__suppress_context__ = True
        return changed.with_traceback(error.__traceback__)
    message = str(error)
    kind: type[TorchDistributedError] = TorchDistributedError
    if error.timed_out:
        kind = TorchTimeoutError
        if timeout is not None:
            message = f"{torch_wording(error.op or 'collective', timeout)}: {message}"
    converted = kind(message, op=error.op, group=error.group, rank=error.rank, peer=error.peer,
                     root_cause=error.root_cause, timed_out=error.timed_out)
    converted.__cause__ = error.__cause__
    converted.__suppress_context__ = True
    return converted.with_traceback(error.__traceback__)
