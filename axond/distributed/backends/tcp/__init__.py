"""The tcp backend: collectives over a mesh of authenticated TCP sockets, and shared memory between the ranks of
one host.

    backend.py     checks, op numbering, one template running each op along its route
    options.py     every knob (`TcpOptions`); `TcpOptions.from_env` is the only reader of AXOND_TCP_*/AXOND_SHM*
    policy.py      which path and schedule each op takes, holding every threshold
    placement.py   which members share a host and what shared memory they mapped
    transport/     connection set-up and handshake, the peer that owns its socket, framing, wire format
    schedules/     ring, pairwise, tree and one-round schedules as functions over a `Comm`
    shm/           the arena and mailbox of ranks on one host, and their schedules
    hierarchy/     topology and two-level ops for groups spread over hosts
"""


from __future__ import annotations

from typing import Any

from axond.distributed.backends.tcp.options import TcpOptions

__all__ = ["BACKEND", "TcpBackend", "TcpOptions"]


def __getattr__(name: str) -> Any:
    """The backend class, imported on first use: `BackendOptions` (in `backends.base`, which the backend imports)
    names this package's options and handshake timeout."""
    if name in ("BACKEND", "TcpBackend"):
        from axond.distributed.backends.tcp import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
