"""Domain exceptions of the coordinator state machine; the servicer maps each to a gRPC status."""

from __future__ import annotations

import math

from axond.errors import CoordinatorError

MAX_WAIT_S = 86400.0
"""Longest wait a request may ask for (one day); long-polls longer than that should loop."""

MAX_NAME_CHARS = 256
"""Longest job, barrier or host name accepted."""

MAX_KEY_CHARS = 1024
"""Longest store key accepted."""


class StateError(CoordinatorError):
    """A request the state machine refuses; subclasses pick the status code."""


class InvalidArgument(StateError):
    """A field is malformed (empty, out of range, too large)."""


class NotFound(StateError):
    """The job, node or key named does not exist."""


class FailedPrecondition(StateError):
    """The request is well-formed but does not fit the current state (stale generation, finished job)."""


class AlreadyExists(StateError):
    """A job of that name is already active."""


class ResourceExhausted(StateError):
    """A coordinator limit (nodes, jobs, store bytes, queued jobs) would be exceeded."""


class PermissionDenied(StateError):
    """The caller is not allowed to act for that node or job (wrong node secret, not a member)."""


class Unavailable(StateError):
    """The coordinator cannot serve this now (its state could not be written); the call may be retried."""


class OutOfRange(StateError):
    """A counter would leave its range (KvAdd past int64)."""


QUOTE_CHARS = 64
"""Characters of a caller's string quoted back in an error message."""


def short(value: str) -> str:
    """`value` quoted for an error message, cut to QUOTE_CHARS characters."""
    if len(value) <= QUOTE_CHARS:
        return repr(value)
    return f"{value[:QUOTE_CHARS]!r}... ({len(value)} characters)"


def check_name(what: str, value: str, limit: int = MAX_NAME_CHARS) -> str:
    """Return `value` if it is a usable name, else raise InvalidArgument naming `what`."""
    if not value:
        raise InvalidArgument(f"{what} must be a non-empty string")
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters; the limit is {limit}")
    if not value.isprintable() or " " in value:  # (isprintable: no control or separator character but " ")
        raise InvalidArgument(f"{what} {short(value)} must not contain whitespace or control characters")
    return value


def check_at_most(what: str, value: int, limit: int, name: str) -> int:
    """Return `value` if it is <= `limit`, else raise InvalidArgument naming the limit field `name`."""
    if value > limit:
        raise InvalidArgument(f"{what} is {value}; the coordinator's limit is {limit} ({name})")
    return value


def check_wait(what: str, seconds: float, allow_zero: bool = True) -> float:
    """Return a wait in seconds if it is finite, >= 0 (> 0 unless `allow_zero`) and <= MAX_WAIT_S."""
    if math.isnan(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidArgument(f"{what} is {seconds}; it must be {bound} seconds")
    if seconds > MAX_WAIT_S:
        raise InvalidArgument(f"{what} is {seconds} s; the limit is {MAX_WAIT_S:.0f} s, loop for longer waits")
    return seconds


def check_positive(what: str, value: int) -> int:
    """Return `value` if it is >= 1."""
    if value < 1:
        raise InvalidArgument(f"{what} is {value}; it must be >= 1")
    return value
