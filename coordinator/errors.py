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
    """A per-job limit (store size) would be exceeded."""


def check_name(what: str, value: str) -> str:
    """Return `value` if it is a usable name, else raise InvalidArgument naming `what`."""
    if not value:
        raise InvalidArgument(f"{what} must be a non-empty string")
    if len(value) > MAX_NAME_CHARS:
        raise InvalidArgument(f"{what} is {len(value)} characters; the limit is {MAX_NAME_CHARS}")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise InvalidArgument(f"{what} {value!r} must not contain whitespace or control characters")
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
