"""A team: a subset of a group's members that runs the group's algorithms on the group's own sockets.

Hierarchical ops (see `topology`) run one team per node (its members, through their shared-memory
arena) and one across the nodes (a member and its counterparts, over the sockets).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.framing import FramedGroup, TcpTuning
from axond.distributed.shm import ShmArena, ShmTuning
from axond.distributed.shm_algorithms import ShmAlgorithms
from axond.distributed.tcp_algorithms import TcpAlgorithms


class Team(TcpAlgorithms, ShmAlgorithms):
    """Group ranks `members` of a group (this rank among them) numbered 0..k-1, on the group's sockets.

    It runs the group's algorithms inside one of the group's ops: the same call and frame headers, so a
    mismatched or dead peer raises as in the group, whose `run` then aborts it. Scratch buffers are the
    group's (one op at a time uses them).
    """

    def __init__(self, g: FramedGroup, rank: int, members: tuple[int, ...], tuning: TcpTuning, crowded: bool,
                 shm: ShmTuning, scratch: Callable[[int, np.dtype, int], np.ndarray],
                 rolling: Callable[[int, np.dtype], np.ndarray]) -> None:
        self.members = members
        self.g = g.subset(list(members))
        self.rank = members.index(rank)
        self.size = len(members)
        self.tuning = tuning
        self.crowded = crowded
        self.shm = shm
        self._scratch = scratch
        self._rolling = rolling
        self._arena: ShmArena | None = None
        self._token = np.zeros(1, np.uint8)

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None
