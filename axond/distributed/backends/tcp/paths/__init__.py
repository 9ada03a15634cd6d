"""One object per path an op of a tcp group can take, each with the same methods (`DataPath`).

    base.py         the interface, and what the paths share (this rank's row of an all_gather, a barrier over sockets)
    sockets.py      the group's sockets (`schedules.sockets`): always there
    mailbox.py      the shared mailbox of a group on one host: small ops, and their prepared forms
    single_copy.py  peers' buffers read directly (process_vm_readv): large ops of a group on one host
    arena.py        the shared arena of a group on one host: large ops where single copy cannot run
    two_level.py    each host's arena, then across hosts: large ops of a group spread over hosts

`Placement.choose` gives each op its path object (`policy.candidates` decides which); the backend's ops call its
methods without knowing which path it is.
"""

from axond.distributed.backends.tcp.paths.arena import ArenaPath
from axond.distributed.backends.tcp.paths.base import DataPath
from axond.distributed.backends.tcp.paths.mailbox import MailboxPath
from axond.distributed.backends.tcp.paths.single_copy import SingleCopyPath
from axond.distributed.backends.tcp.paths.sockets import SocketsPath
from axond.distributed.backends.tcp.paths.two_level import TwoLevelPath

__all__ = ["ArenaPath", "DataPath", "MailboxPath", "SingleCopyPath", "SocketsPath", "TwoLevelPath"]
