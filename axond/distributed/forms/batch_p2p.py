"""`batch_isend_irecv` and `P2POp`, as torch's: a list of sends and receives that may not deadlock.

Posting a list of isends and irecvs one by one can deadlock when both sides of a pair start with a
receive (or, on NCCL, with a large send). A batch is free of that: on tcp every send is posted first
(they never wait for the receiver), then every receive, on the group's communication thread; on
nccl all of them go in one ncclGroupStart/End. The Works come back in the list's order. Between a
pair of ranks, sends and receives still match in the order they were listed, tags included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from axond.distributed.api import _group, irecv, isend
from axond.distributed.backends.base import Array
from axond.distributed.process_group import ProcessGroup
from axond.distributed.work import Work


@dataclass
class P2POp:
    """One send or receive of `batch_isend_irecv`: `op` is `axond.isend` or `axond.irecv`; `peer` a global rank."""

    op: Callable[..., Any]
    tensor: Array
    peer: int
    group: ProcessGroup | None = None
    tag: int = 0

    def __post_init__(self) -> None:
        if self.op not in (isend, irecv):
            name = getattr(self.op, "__name__", repr(self.op))
            raise TypeError(f"P2POp op must be axond.isend or axond.irecv, got {name}")


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Start every send and receive of the list (one group for all); their Works, in the list's order."""
    ops = list(p2p_op_list)
    if not ops or not all(isinstance(o, P2POp) for o in ops):
        raise ValueError("batch_isend_irecv needs a non-empty list of axond.P2POp")
    g = _group(ops[0].group)
    if any(_group(o.group) is not g for o in ops):
        raise ValueError("batch_isend_irecv: every P2POp of a batch must use the same group")
    batch = [("isend" if o.op is isend else "irecv", o.tensor, g.group_rank(o.peer), int(o.tag)) for o in ops]
    return g.batch_isend_irecv(batch)
