"""Calls to coordinator replicas (`--coordinator H1:P1,H2:P2`): sent to the replica believed to lead.

A follower answers UNAVAILABLE with the leader's address in the `axond-leader` trailing metadata: the
call goes there at once. A replica that does not answer (dead, restarting, no leader elected yet) is
passed over for the next one; after a whole round without an answer the client pauses (doubling up
to `MAX_PAUSE_S`) before the next round, all within the call's deadline. Only calls that surely did
not run (turned away, nothing listening) or are safe to repeat are sent again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from axond.v1 import coordinator_pb2_grpc as pb_grpc

LEADER_METADATA = "axond-leader"
"""Trailing metadata key naming the leader's HOST:PORT in a follower's answer."""
FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 0.25


def leader_named(e: grpc.RpcError) -> str | None:
    """The leader's address a follower replica gave with its UNAVAILABLE answer, if any."""
    try:
        metadata: Any = e.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:
        return None
    for item in metadata:
        key, value = item[0], item[1]
        if key == LEADER_METADATA:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


class _ToActive:
    """Looks like a generated stub; each method goes to the replica active when it is called."""

    def __init__(self, replicas: Replicas, stubs: Sequence[Any]) -> None:
        self._replicas = replicas
        self._stubs = stubs

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def send(*args: Any, **kwargs: Any) -> Any:
            return getattr(self._stubs[self._replicas.active], name)(*args, **kwargs)

        return send


class Replicas:
    """One channel per replica and which one calls go to."""

    def __init__(self, channels: Sequence[grpc.Channel], addresses: Sequence[str]) -> None:
        self.channels = list(channels)
        self.addresses = list(addresses)
        self.active = 0
        """Index of the replica calls go to (the leader, as far as this client knows)."""
        self._missed = 0
        """Replicas passed over since the last answer."""
        self._lock = threading.Lock()
        self.stub: Any = _ToActive(self, [pb_grpc.CoordinatorStub(c) for c in self.channels])
        self.health: Any = _ToActive(self, [health_pb2_grpc.HealthStub(c) for c in self.channels])

    @property
    def active_address(self) -> str:
        return self.addresses[self.active]

    def answered(self) -> None:
        """The active replica answered a call."""
        self._missed = 0

    def fail_over(self, e: grpc.RpcError, may_resend: bool) -> float | None:
        """After UNAVAILABLE from the active replica: move to the leader it named, else to the next replica;
        returns the pause before sending again, or None when the call must not be sent again."""
        if not may_resend:
            return None
        leader = leader_named(e)
        with self._lock:
            self._missed += 1
            if leader in self.addresses and self.addresses.index(leader) != self.active:
                self.active = self.addresses.index(leader)
                return 0.0 if self._missed <= len(self.addresses) else FIRST_PAUSE_S
            self.active = (self.active + 1) % len(self.addresses)
            rounds, rest = divmod(self._missed, len(self.addresses))
            if rest:
                return 0.0
            return min(MAX_PAUSE_S, FIRST_PAUSE_S * 2 ** min(rounds - 1, 8))

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
