"""How each path of a tcp group runs once `policy` chose it: its steps and chunks, how its waits poll, yield and block,
and the sockets' frames and buffers.

Like `policy`, a table: each constant says in one line what it decides, and `(#name)` is its entry in
docs/design/tuning.md (the machine, command, date and measurements behind the value). `policy` re-exports them.
"""

from __future__ import annotations

from axond.distributed.backends import chunking
from axond.distributed.backends.tcp.options import TcpOptions
from axond.distributed.backends.tcp.transport.wire import Op

MAILBOX_POLL_SECONDS = 0.002
"""How long a compiled mailbox wait polls the members' posts without a system call before it blocks, where the host's
ranks do not outnumber its cores (#mailbox_poll_seconds)."""
MAILBOX_QUICK_TURNS = 32
"""Turns (`sched_yield`) a mailbox wait takes for the members' posts before it blocks, where the host's ranks outnumber
its cores (#mailbox_quick_turns)."""
MAILBOX_YIELD_LIMIT_SECONDS = 200e-6
"""Where a mailbox wait's yields took longer than this lately (an average), they ran another process, not the member
waited for: the waits block at once instead (#mailbox_yield_limit_seconds)."""
MAILBOX_PROBE_OPS = 1024
"""At most this many mailbox ops between two waits that yield although the waits block, to see whether yielding is
cheap again (#mailbox_probe_ops)."""
MAILBOX_PROBE_FIRST_OPS = 16
"""The fewest mailbox ops between two such waits: where yielding turned cheap, the tries come this often
(#mailbox_probe_first_ops)."""
MAILBOX_HOME_EVERY_OPS = 64
"""Mailbox ops between two looks at the core a crowded host's rank runs on, moving it back home if the kernel moved it
(#mailbox_home_every_ops)."""
MAILBOX_MOVE_EVERY_OPS = 16
"""The fewest mailbox ops between two moves of a rank off a core it found shared with another rank of its group
(#mailbox_move_every_ops)."""
MAILBOX_SPIN_SECONDS = 0.01
"""How long a mailbox wait without the compiled helper spins before it sleeps on the sockets (#mailbox_spin_seconds)."""
MAILBOX_CHECK_SECONDS = 0.0005
"""How long a compiled mailbox wait blocks (futex) before it looks at the sockets for aborts, dead peers and mismatched
calls; how often a spinning wait without it looks (#mailbox_check_seconds)."""
MAILBOX_SLEEP_SECONDS = 0.002
"""How long each later block of a mailbox wait lasts before it looks at the sockets again (a post wakes it at once)
(#mailbox_sleep_seconds)."""

STEP_BYTES = 1 << 20
"""Bytes per step of an arena all_reduce (and a two-rank broadcast from PAIR_BROADCAST_STEP_MIN_BYTES) (#step_bytes)."""
PAIR_BROADCAST_STEP_MIN_BYTES = 4 << 20
"""Size from which a two-rank arena broadcast runs in STEP_BYTES steps (#pair_broadcast_step_min_bytes)."""
SINGLE_COPY_CHUNK_BYTES = 1 << 20
"""Bytes the single-copy path reads from each peer before reducing them (#single_copy_chunk_bytes)."""
BOUNCE_BYTES = 1 << 20
"""Bytes per single-copy read through the bounce buffer (its size) (#bounce_bytes)."""
BOUNCE_MIN_BYTES = 64 << 10
"""Single-copy reads at a slow page distance from this size go through the bounce buffer (#bounce_min_bytes)."""

TWO_LEVEL_STEP_BYTES = 1 << 20
"""Bytes per step of a host's part of a two-level op (#two_level_step_bytes)."""

PIPELINE_CHUNK_BYTES = (64 << 10, 1 << 20)
"""The (least, most) pipeline chunk of the socket rings, chains and trees (auto `chunk_bytes`: a quarter of a block)
(#pipeline_chunk_bytes)."""
INLINE_SEND_BYTES = 64 << 10
"""Frames up to this size are sent from the calling thread whatever `inline_bytes` says (they fit the socket buffer)
(#inline_send_bytes)."""
SMALL_FRAME = 4096
"""Payloads up to this size are received together with their header in one call (#small_frame)."""
SOCKET_BUFFER_BYTES = 4 << 20
"""Auto socket buffer size where the kernel allows it (else the kernel's autotuning) (#socket_buffer_bytes)."""
AUTO_SPIN_SECONDS = 50e-6
"""Default busy-poll time of small receives when the host's ranks do not outnumber its cores (#auto_spin_seconds)."""


def socket_buffer_bytes(options: TcpOptions, limit: int) -> int:
    """Each socket's buffer size (0: the kernel's autotuning) on a host that lets a process set at most `limit`
    (`sockets.buffer_limit`)."""
    if options.socket_buffer_bytes >= 0:
        return options.socket_buffer_bytes
    return SOCKET_BUFFER_BYTES if limit >= SOCKET_BUFFER_BYTES else 0


def mailbox_poll_seconds(options: TcpOptions, oversubscribed: bool) -> float:
    """How long a compiled mailbox wait polls before it blocks: `shm_poll_us`, else MAILBOX_POLL_SECONDS, or 0 where the
    host's ranks outnumber its cores (a polling rank would hold the core its peer needs; that wait yields instead,
    MAILBOX_QUICK_TURNS times)."""
    if options.shm_poll_us >= 0:
        return options.shm_poll_us * 1e-6
    return 0.0 if oversubscribed else MAILBOX_POLL_SECONDS


def mailbox_turns(oversubscribed: bool) -> int:
    """Yields a compiled mailbox wait takes after its polling, before it blocks: MAILBOX_QUICK_TURNS where the host's
    ranks outnumber its cores (the peer it waits for may be on this core), else none (the peer is elsewhere; a yield
    would only hand this core to another process)."""
    return MAILBOX_QUICK_TURNS if oversubscribed else 0


def spin_seconds(options: TcpOptions, oversubscribed: bool) -> float:
    if options.spin_us >= 0:
        return options.spin_us * 1e-6
    return 0.0 if oversubscribed else AUTO_SPIN_SECONDS


def pipeline_chunk_bytes(block_bytes: int, options: TcpOptions) -> int:
    """Chunk size for pipelining a block over the sockets: `chunk_bytes` if set, else about a quarter of the block,
    clamped to PIPELINE_CHUNK_BYTES."""
    return chunking.pipeline_chunk_bytes(block_bytes, options.chunk_bytes, *PIPELINE_CHUNK_BYTES)


def arena_step(op: Op, nbytes: int, size: int) -> int:
    """Bytes per step of op `op` on `nbytes` per rank through the arena of a one-host group of `size` (0: a whole
    slot): STEP_BYTES for an all_reduce, and for a two-rank broadcast from PAIR_BROADCAST_STEP_MIN_BYTES."""
    if op is Op.ALL_REDUCE or (size == 2 and op is Op.BROADCAST and nbytes >= PAIR_BROADCAST_STEP_MIN_BYTES):
        return STEP_BYTES
    return 0
