"""The transport's failures with one peer, raised by both halves of its connection (`peer`, `outbox`)."""

from __future__ import annotations


class PeerError(Exception):
    """A transport failure with peer group rank `peer`; the backend turns it into `DistributedError`."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class PeerClosed(PeerError):
    """The peer closed the connection or the link failed."""


class PeerTimeout(PeerError):
    """The peer did not send or accept data in time."""
