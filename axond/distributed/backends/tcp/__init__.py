"""The tcp backend: collectives over a mesh of authenticated TCP sockets, and shared memory between the ranks of
one host.

    backend.py     checks, op numbering, each op a few lines over the path `Placement.choose` gives it
    prepared.py    the mailbox's prepared small ops as runners for the group's fast path
    options.py     every knob (`TcpOptions`); `TcpOptions.from_env` is the only reader of AXOND_TCP_*/AXOND_SHM*
    policy.py      which path and schedule each op takes, holding every threshold
    placement.py   which members share a host and what shared memory they mapped
    paths/         one object per path (mailbox, single copy, arena, two levels, sockets), the same methods on each
    transport/     connection set-up and handshake, the peer that owns its socket, framing, wire format
    schedules/     ring, pairwise, tree and one-round schedules as functions over a `GroupView`
    shm/           the arena and mailbox of ranks on one host, and their schedules
    hierarchy/     topology and two-level ops for groups spread over hosts
"""

from axond.distributed.backends.tcp.backend import BACKEND, TcpBackend
from axond.distributed.backends.tcp.options import TcpOptions

__all__ = ["BACKEND", "TcpBackend", "TcpOptions"]
