"""Activations forward and gradients backward between pipeline stages, over a group's send/recv.

Wire protocol, per message from rank a to rank b (group-local ranks):
- an activation is a small int64 header (tag ACT_HEADER_TAG: dtype code, ndim, dims) followed by
  the array (tag ACT_TAG), so the receiver learns shape and dtype from the message itself;
- a gradient is the bare array (tag GRAD_TAG): its shape and dtype are those of the activation the
  receiver sent forward for the same (microbatch, stage), which it recorded when sending.
Sends are `isend` (they never wait for the receiver); receives are blocking `recv` with the group's
timeout, so a dead or stuck peer raises `DistributedError` instead of hanging.

A TCP stream between two ranks is ordered, but a rank may consume messages of one peer in another
order than the peer produced them (with two ranks and interleaving, activations and gradients share
a link). Both sides run pure schedule functions, so each receiver knows its peers' send order:
`recv_*` reads a peer's messages in that order, parking early arrivals in a mailbox until needed.
That never waits for more than the wanted message implies, so it keeps the schedule deadlock-free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Literal

import numpy as np

from axond.distributed.process_group import ProcessGroup
from axond.distributed.ops import DTYPES, dtype_code
from axond.distributed.work import Work
from axond.nn.device import Array
from axond.parallel.pipeline.schedules import Action, stage_rank

ACT_HEADER_TAG = 71
ACT_TAG = 72
GRAD_TAG = 73
MAX_DIMS = 6
"""Activations may have up to this many dimensions (the header has a fixed size)."""

MessageKey = tuple[Literal["act", "grad"], int, int]
"""(kind, microbatch, receiving stage)."""


def incoming_order(action_lists: Sequence[Sequence[Action]], rank: int, num_stages: int) -> dict[int, list[MessageKey]]:
    """For each peer, the messages it sends to `rank`, in the order it sends them.

    `action_lists[p]` is group rank p's schedule; a forward of stage s sends its output to stage
    s + 1, a backward of stage s sends the input gradient to stage s - 1.
    """
    size = len(action_lists)
    order: dict[int, list[MessageKey]] = {}
    for peer, actions in enumerate(action_lists):
        if peer == rank:
            continue
        keys: list[MessageKey] = []
        for a in actions:
            s = a.stage(peer, size)
            if a.kind == "F" and s + 1 < num_stages and stage_rank(s + 1, size) == rank:
                keys.append(("act", a.microbatch, s + 1))
            elif a.kind == "B" and s > 0 and stage_rank(s - 1, size) == rank:
                keys.append(("grad", a.microbatch, s - 1))
        if keys:
            order[peer] = keys
    return order


class StageLinks:
    """This rank's end of every stage-to-stage link for one pass of a schedule."""

    def __init__(self, group: ProcessGroup, incoming: dict[int, list[MessageKey]], xp: ModuleType) -> None:
        self.group = group
        self.xp = xp
        self._expected = {peer: deque(keys) for peer, keys in incoming.items()}
        self._mailbox: dict[MessageKey, Array] = {}
        self._sent_meta: dict[tuple[int, int], tuple[tuple[int, ...], Any]] = {}
        self._sends: list[Work] = []

    def send_activation(self, x: Array, microbatch: int, to_stage: int, dst: int) -> None:
        """Ship stage `to_stage - 1`'s output for `microbatch` to the rank holding `to_stage`."""
        self._sent_meta[(microbatch, to_stage - 1)] = (tuple(x.shape), x.dtype)
        if dst == self.group.rank:
            self._mailbox[("act", microbatch, to_stage)] = x
            return
        if x.ndim > MAX_DIMS:
            raise ValueError(f"pipeline activations may have at most {MAX_DIMS} dimensions, stage {to_stage - 1} "
                             f"produced shape {tuple(x.shape)}; reshape inside the stage")
        header = np.zeros(2 + MAX_DIMS, np.int64)
        header[0] = dtype_code(np.dtype(x.dtype))
        header[1] = x.ndim
        header[2:2 + x.ndim] = x.shape
        self._sends.append(self.group.isend(header, dst, ACT_HEADER_TAG))
        self._sends.append(self.group.isend(self.xp.ascontiguousarray(x), dst, ACT_TAG))

    def send_grad(self, g: Array, microbatch: int, to_stage: int, dst: int) -> None:
        """Ship d loss / d input of stage `to_stage + 1` for `microbatch` back to the rank holding `to_stage`."""
        if dst == self.group.rank:
            self._mailbox[("grad", microbatch, to_stage)] = g
            return
        self._sends.append(self.group.isend(self.xp.ascontiguousarray(g), dst, GRAD_TAG))

    def recv_activation(self, microbatch: int, stage: int, src: int) -> Array:
        """The input of `stage` for `microbatch`, produced by group rank `src`."""
        return self._take(("act", microbatch, stage), src)

    def recv_grad(self, microbatch: int, stage: int, src: int) -> Array:
        """d loss / d output of `stage` for `microbatch`, produced by group rank `src`."""
        return self._take(("grad", microbatch, stage), src)

    def wait_sends(self) -> None:
        """Wait until every send left this process (re-raising its failure) and drop the references."""
        sends, self._sends = self._sends, []
        for work in sends:
            work.wait()

    def _take(self, key: MessageKey, src: int) -> Array:
        while key not in self._mailbox:
            queue = self._expected.get(src)
            if not queue or key not in queue:
                raise RuntimeError(f"pipeline rank {self.group.rank} waits for {key} from rank {src}, which its "
                                   f"schedule never sends: the ranks run different schedules or microbatch counts")
            self._receive(queue.popleft(), src)
        return self._mailbox.pop(key)

    def _receive(self, key: MessageKey, src: int) -> None:
        kind, microbatch, stage = key
        if kind == "act":
            header = np.zeros(2 + MAX_DIMS, np.int64)
            self.group.recv(header, src, ACT_HEADER_TAG)
            code, ndim = int(header[0]), int(header[1])
            if not 1 <= code <= len(DTYPES) or not 0 <= ndim <= MAX_DIMS:
                raise RuntimeError(f"pipeline rank {self.group.rank} got a corrupt activation header {header.tolist()} "
                                   f"from rank {src}")
            buf = self.xp.empty(tuple(int(d) for d in header[2:2 + ndim]), DTYPES[code - 1])
            self.group.recv(buf, src, ACT_TAG)
        else:
            shape, dtype = self._sent_meta[(microbatch, stage)]
            buf = self.xp.empty(shape, dtype)
            self.group.recv(buf, src, GRAD_TAG)
        self._mailbox[key] = buf
