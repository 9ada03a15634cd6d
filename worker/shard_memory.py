"""Memory the worker daemon keeps for each local rank of a live job: ZeRO-1's copies of the rank's shards, which
outlive the rank (`axond.train.daemon_copy`), sent from there to the buddy's worker on the rank's word
(`axond.worker.copy_forward`); and, through its relay, the buddy copies other nodes' workers send this node
(`axond.worker.buddy_relay`).

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
from axond.worker.copy_forward import Forwarder, new_node_key

SHARD_MEMORY_ENV = "AXOND_SHARD_MEMORY_FD"


class ShardMemory:
    """The worker's memfd per local rank (none where the platform has no `memfd_create`)."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self.relay: BuddyRelay | None = None
        self._forwarders: dict[int, Forwarder] = {}
        self._secret = b""
        self._node = new_node_key()
        self._notice: Callable[[str], None] = lambda line: None

    def forward_fd(self, local_rank: int) -> int | None:
        """The pipe through which `local_rank` asks this worker to send its buddy copies (once the relay runs)."""
        if self.relay is None:
            return None
        memory = self.fd(local_rank)
        if memory is None:
            return None
        if local_rank not in self._forwarders:
            self._forwarders[local_rank] = Forwarder(memory, local_rank, self._node, lambda: self._secret,
                                                     self._notice)
        return self._forwarders[local_rank].write_fd

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
        self._secret, self._notice = secret, notice  # the forwarders prove the newest generation's secret
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
        forwarders, self._forwarders = self._forwarders, {}
        for forwarder in forwarders.values():
            forwarder.close()
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.close()
