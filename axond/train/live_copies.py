"""Where a live job's ZeRO-1 and FSDP copies go, and the shards rebuilt from them after a re-formation: the part of
`axond.train.live.VirtualSteps` that places the buddy copies (`axond.train.buddy`; through the workers' relays,
`axond.train.relay`, when every rank's worker runs one), routes FSDP's gradients to the buddies, and re-shards in
memory (`axond.train.reassemble`), falling back to a checkpoint only when both copies of a shard were lost.
"""

from __future__ import annotations

import os
import secrets
import socket
import warnings
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

import axond.checkpoint as ckpt
from axond.errors import DistributedError
from axond.parallel.fsdp.virtual import VirtualFSDP
from axond.parallel.zero.virtual import VirtualZero
from axond.train.buddy import BuddyCopies, buddies
from axond.train.daemon_copy import DaemonCopy
from axond.train.reassemble import reassemble
from axond.train.relay import RelayedCopies, address_words, words_address

if TYPE_CHECKING:
    from axond.train.trainer import DistributedTrainer


def node_key() -> int:
    """This rank's failure domain: the worker daemon that runs it (its host and process id)."""
    return zlib.crc32(f"{socket.gethostname()}:{os.getppid()}".encode())




class LiveCopies:
    """The copies' side of `VirtualSteps` (a mixin: it reads the trainer, the optimizer and the copies there)."""

    trainer: DistributedTrainer
    zero: VirtualZero | None
    copies: BuddyCopies | None
    daemon: DaemonCopy | None
    relay: str | None
    relayed: RelayedCopies | None
    lineage: int
    started: bool
    fell_back: str | None

    def _table(self, group: Any, drawn: int = 0) -> np.ndarray:
        """Every rank's (node key, `drawn`, its worker's relay address words) (collective)."""
        mine = np.concatenate([np.array([node_key(), drawn], np.int64), address_words(self.relay)])
        return np.asarray(group.all_gather(mine)).reshape(group.size, mine.size)

    def _relay_mode(self, table: np.ndarray) -> list[str | None]:
        """Every rank's relay address in `table`; the buddy copies go through the workers when every rank has one."""
        assert self.copies is not None
        relays = [words_address(row[2:]) for row in table]
        self.copies.relayed = self.relayed if self.relayed is not None and all(relays) else None
        return relays

    def _place_copies(self, group: Any, table: np.ndarray) -> None:
        """The buddies of the new layout; the copies go through the workers when every rank's has a relay."""
        assert self.copies is not None
        nodes = [int(n) for n in table[:, 0]]
        self.copies.place(group, nodes)
        self._route(nodes)
        relays = self._relay_mode(table)
        if self.relayed is not None and self.copies.relayed is not None:
            buddy = self.copies.buddy
            self.relayed.target(relays[buddy] if buddy >= 0 else None)

    def _start_copies(self) -> None:
        """ZeRO-1, every rank of a job that starts (never a rank joining a running one, whose peers run no such
        collective): the buddies, and a lineage of daemon copies drawn by rank 0 (collective)."""
        group = self.trainer.group
        table = self._table(group, secrets.randbits(62))
        self.lineage = int(table[0, 1])
        if self.copies is not None:
            self._place_copies(group, table)
        self.started = True

    def _route(self, nodes: list[int]) -> None:
        """FSDP: each rank's buddy also receives the reduced gradient of the blocks it holds copies of."""
        if isinstance(self.zero, VirtualFSDP):
            self.zero.route(buddies(nodes))

    def _reshard(self, group: Any, fresh: bool = False) -> tuple[list[int], list[int], list[int]]:
        """ZeRO-1: rebuild every shard at the agreed step in memory and carry the new block; post the new copies
        (`fresh`: this rank joined the running job: it offers its worker daemon's copy of a lost rank's block).
        Returns the shards rebuilt from copies, those of them advanced from an older copy, and those from a daemon's."""
        if self.zero is None:
            return [], [], []
        t = self.trainer
        agreed = t.position.global_step
        table = self._table(group)
        if self.copies is not None:
            self._relay_mode(table)  # a joining rank too offers the copies its node holds
        daemon = self.daemon.holding(agreed, self.lineage) if fresh and self.daemon is not None else None
        if fresh:
            self.zero.tag = -1  # it carried nothing: it offers no state of its own
        if isinstance(self.zero, VirtualFSDP):  # no rank holds the whole gradient to advance a daemon copy with
            self.zero.grad_tag = -1  # (a buddy holds its sources' blocks' gradients: its older copies still advance)
        done = reassemble(self.zero, self.copies.recovery_holdings() if self.copies is not None else [], group,
                          agreed, daemon)
        if done.lost:
            self._lost(done.lost, group)
        if self.daemon is not None:
            self.daemon.post(self.lineage)  # first: a relayed buddy copy is sent from it
        if self.copies is not None:
            self._place_copies(group, table)
            self.copies.post()
        return done.from_copies, done.replayed, done.from_daemon

    def _lost(self, lost: list[int], group: Any) -> None:
        """Both copies of `lost` shards are gone: load the last checkpoint (and say so), or raise; never go on."""
        t = self.trainer
        why = (f"the optimizer state of virtual shard(s) {lost} at step {t.position.global_step} was lost with both "
               f"its copies (the rank that carried it and its buddy both left, and no replacement rank offered its "
               "worker daemon's copy" +
               (")" if self.copies is not None else "; buddy copies are off: copy_every=None)"))
        assert self.zero is not None
        self.zero.place(group, None)  # the layout the checkpoint is loaded into
        latest = ckpt.latest(t.checkpoint_dir) if t.rank == 0 and t.checkpoint_dir is not None else None
        path = t.comm.broadcast(str(latest) if latest is not None else None)  # one choice for every rank
        if path is None:
            raise DistributedError(f"live recovery cannot go on: {why}, and there is no checkpoint to fall back to "
                                   "(give the trainer checkpoint_dir= and checkpoint_every=)", op="reform",
                                   group=group.name, rank=group.rank)
        if t.rank == 0:
            warnings.warn(f"axond.train: {why}; falling back to the checkpoint {path} read from storage",
                          RuntimeWarning, stacklevel=3)
        t._load(path)
        self.zero.tag = t.position.global_step
        self.lineage += 1  # the steps from here are run again: no daemon copy from before is ever read
        self.fell_back = path
