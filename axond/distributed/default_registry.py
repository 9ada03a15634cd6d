"""The default group `init_process_group` sets up, held in one place, and the one "default group or error" look-up.

A leaf (it imports no other layer), so every layer above the groups (the parallel wrappers, the trainer,
checkpoints, failure reporting, the torch forms) reads the default group here at the top of its module instead of
importing `axond.distributed.api` inside a function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from axond.errors import DistributedError

if TYPE_CHECKING:
    from axond.distributed.process_group import ProcessGroup

_group: ProcessGroup | None = None


class NoDefaultGroup(DistributedError, RuntimeError):
    """No default group was set up: a `DistributedError` (as `axond.default_group()` raises) and a `RuntimeError`
    (as the wrappers that need one raise)."""


def current() -> ProcessGroup | None:
    """The default group, or None before `init_process_group` (and after `destroy_process_group`)."""
    return _group


def install(group: ProcessGroup | None) -> None:
    """Make `group` the default group (None: there is none); `axond.distributed.api` alone calls it."""
    global _group
    _group = group


def require(who: str | None = None) -> ProcessGroup:
    """The default group, or `NoDefaultGroup` saying what to do; `who` (e.g. "DistributedDataParallel") names the
    caller that needed it, which could have been given a group instead."""
    group = _group
    if group is None:
        if who is None:
            raise NoDefaultGroup("the default process group is not initialised; call axond.init_process_group() first")
        raise NoDefaultGroup(f"{who} needs group=..., or axond.init_process_group() called first (the default process "
                             "group is not initialised)")
    return group


def or_given(group: ProcessGroup | None, who: str | None = None) -> ProcessGroup:
    """`group` if given, else the default group (`require`)."""
    return group if group is not None else require(who)
