"""Memory the worker daemon keeps for each local rank of a live job: ZeRO-1's copies of the rank's shards, which
outlive the rank (`axond.train.daemon_copy`); and, through its relay, the buddy copies other nodes' ranks send this
node (`axond.worker.buddy_relay`).

One anonymous shared-memory file (`memfd`) per local rank, created at the rank's first start and held open by the
worker for the job's life: each rank process the worker starts for that local rank inherits it (its number in
`AXOND_SHARD_MEMORY_FD`), maps it and sizes it; a replacement rank finds there the copies of the one before it. The
memory goes when the worker closes it (the job ends for this node) or dies: nothing is left in `/dev/shm`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from axond.worker.buddy_relay import HELD_MEMORY_ENV, RELAY_ENV, BuddyRelay

SHARD_MEMORY_ENV = "AXOND_SHARD_MEMORY_FD"


class ShardMemory:
    """The worker's memfd per local rank (none where the platform has no `memfd_create`)."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self.relay: BuddyRelay | None = None

    def serve(self, host: str, secret: bytes, notice: Callable[[str], None]) -> dict[str, str]:
        """Run this node's relay (once, on `host`), accepting `secret` (this generation's) from now on; the variables
        that tell the ranks where it is and which memory it fills (empty if it cannot run: the ranks then send their
        buddy copies to each other)."""
        if self.relay is None:
            if not hasattr(os, "memfd_create"):
                return {}
            try:
                self.relay = BuddyRelay(host, notice)
            except OSError as e:
                notice(f"cannot run the buddy copies' relay on {host} ({e}): the ranks send them to each other")
                return {}
        self.relay.admit(secret)
        return {HELD_MEMORY_ENV: str(self.relay.held.fd), RELAY_ENV: self.relay.address}

    def fd(self, local_rank: int) -> int | None:
        """The memory of `local_rank`, created on first use (close-on-exec here: only its rank inherits it)."""
        if local_rank not in self._fds:
            create = getattr(os, "memfd_create", None)
            if create is None:
                return None
            try:
                self._fds[local_rank] = create(f"axond-shards-local{local_rank}")
            except OSError:
                return None
        return self._fds[local_rank]

    def close(self) -> None:
        """Free every local rank's memory (the job ended for this node)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.close()
