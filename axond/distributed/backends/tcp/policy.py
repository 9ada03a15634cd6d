"""Which way each op of a tcp group goes: one pure decision per collective, holding every threshold.

A route is a path and, on the sockets, an algorithm:

- `MAILBOX`: small ops of a group on one host, in one round through a shared mailbox (`shm.mailbox`);
- `SINGLE_COPY`: large ops of a group on one host, each rank reading its peers' buffers directly where the host
  allows it (`shm.single_copy`: one copy per byte);
- `ARENA`: large ops of a group on one host, through a shared-memory arena (`shm.arena_ops`: two copies per byte);
- `TWO_LEVEL`: large ops of a group spread over hosts with as many members (two or more) on each: through each
  host's arena and between counterparts over the sockets; on hosts of different sizes (one with two or more),
  all_reduce and broadcast: through each host's arena and between the hosts' first members (`hierarchy.two_level`);
- `SOCKETS`: framed messages over the group's sockets, by the algorithm `socket_algorithm` picks (`schedules`).

`candidates` lists the paths an op may take, best first; the backend takes the first whose shared memory every
member mapped, or (single copy) whose memory every member can read (the sockets always work). `route` answers
"which path does a 1 MiB all_reduce on 4 ranks take?" for a group whose memory maps:
`route(Op.ALL_REDUCE, 1 << 20, Shape(4))`. Sizes are the bytes of one rank's
input; every rank of a group computes the same route from the same arguments.

The constants are the decision table: each says in one line what it decides, and `(#name)` is its entry in
docs/design/tuning.md (the machine, command, date and measurements behind the value). The defaults assume that page's
machine, a 2-core x86 VM with every rank on loopback; re-measure them there for another one. How a path runs once
chosen (its steps and chunks, its waits, the sockets' frames and buffers) is the table of `tuning`, re-exported here.
"""

from __future__ import annotations

import enum
import platform
from dataclasses import dataclass
from typing import NamedTuple

from axond.distributed.backends.tcp.options import TcpOptions
from axond.distributed.backends.tcp.tuning import (
    MAILBOX_POLL_SECONDS as MAILBOX_POLL_SECONDS, MAILBOX_QUICK_TURNS as MAILBOX_QUICK_TURNS,
    MAILBOX_YIELD_LIMIT_SECONDS as MAILBOX_YIELD_LIMIT_SECONDS, MAILBOX_PROBE_OPS as MAILBOX_PROBE_OPS,
    MAILBOX_PROBE_FIRST_OPS as MAILBOX_PROBE_FIRST_OPS, MAILBOX_HOME_EVERY_OPS as MAILBOX_HOME_EVERY_OPS,
    MAILBOX_MOVE_EVERY_OPS as MAILBOX_MOVE_EVERY_OPS, MAILBOX_SPIN_SECONDS as MAILBOX_SPIN_SECONDS,
    MAILBOX_CHECK_SECONDS as MAILBOX_CHECK_SECONDS, MAILBOX_SLEEP_SECONDS as MAILBOX_SLEEP_SECONDS,
    STEP_BYTES as STEP_BYTES, PAIR_BROADCAST_STEP_MIN_BYTES as PAIR_BROADCAST_STEP_MIN_BYTES,
    SINGLE_COPY_CHUNK_BYTES as SINGLE_COPY_CHUNK_BYTES, BOUNCE_BYTES as BOUNCE_BYTES,
    BOUNCE_MIN_BYTES as BOUNCE_MIN_BYTES, TWO_LEVEL_STEP_BYTES as TWO_LEVEL_STEP_BYTES,
    PIPELINE_CHUNK_BYTES as PIPELINE_CHUNK_BYTES, INLINE_SEND_BYTES as INLINE_SEND_BYTES, SMALL_FRAME as SMALL_FRAME,
    SOCKET_BUFFER_BYTES as SOCKET_BUFFER_BYTES, AUTO_SPIN_SECONDS as AUTO_SPIN_SECONDS,
    socket_buffer_bytes as socket_buffer_bytes, mailbox_poll_seconds as mailbox_poll_seconds,
    mailbox_turns as mailbox_turns, spin_seconds as spin_seconds, pipeline_chunk_bytes as pipeline_chunk_bytes,
    arena_step as arena_step,
)
from axond.distributed.backends.tcp.transport.wire import Op

ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
"""Whether stores become visible to other cores in program order (x86's TSO), which the mailbox relies on."""

MAILBOX_BYTES = 256 << 10
"""Largest payload per rank through the mailbox of 3-5 ranks (the arena above it) (#mailbox_bytes)."""
MAILBOX_PAIR_BYTES = 512 << 10
"""Largest payload per rank through the mailbox of two ranks (#mailbox_pair_bytes)."""
MAILBOX_ALL_REDUCE_BYTES = 256 << 10
"""Largest all_reduce payload per rank through the mailbox (above it, the arena's pair all_reduce)
(#mailbox_all_reduce_bytes)."""
MAILBOX_MIN_BYTES = 4 << 10
"""The smallest mailbox slot, in the largest groups (#mailbox_min_bytes)."""
MAILBOX_GROUP_BYTES = 3 << 20
"""The most /dev/shm one group's mailbox takes before its slots shrink (#mailbox_group_bytes)."""
MAILBOX_BROADCAST_SLOTS = 24
"""How many slots' worth a broadcast of more than two ranks takes through the mailbox, in slot-sized chunks
(#mailbox_broadcast_slots)."""

AUTO_MIN_BYTES = (64 << 10, 256 << 10)
"""Default arena threshold where its steps synchronize over the sockets (spare, oversubscribed cores)
(#auto_min_bytes)."""
MAILBOX_SYNC_MIN_BYTES = 4 << 10
"""Default arena threshold where its steps synchronize through the mailbox (#mailbox_sync_min_bytes)."""
CROWDED_BROADCAST_ARENA_SCALE = 16
"""On an oversubscribed host with a mailbox, the multiple of `shm_min_bytes` from which broadcast takes the arena
(#crowded_broadcast_arena_scale)."""
SINGLE_COPY_MIN_BYTES: dict[Op, tuple[int, int]] = {
    Op.ALL_GATHER: (8 << 20, 8 << 20), Op.BROADCAST: (16 << 20, 16 << 20), Op.REDUCE_SCATTER: (4 << 20, 16 << 20),
    Op.ALL_REDUCE: (1 << 62, 16 << 20)}
"""Size from which an op of a one-host group takes the single-copy path instead of the arena (two ranks, more)
(#single_copy_min_bytes)."""
COMPILED_SINGLE_COPY_BYTES: dict[tuple[Op, bool], tuple[tuple[int, int], ...]] = {
    (Op.BROADCAST, False): ((8 << 20, 1 << 62),),
    (Op.ALL_GATHER, False): ((4 << 20, 1 << 62),),
    (Op.ALL_GATHER, True): ((2 << 20, 1 << 62),),
}
"""Sizes at which the compiled single copy goes ahead of the mailbox or the arena (#compiled_single_copy_bytes)."""

LEADER_SCALE = {Op.ALL_REDUCE: 2, Op.BROADCAST: 4}
"""Hosts of different sizes take the leaders' two levels from this multiple of `shm_min_bytes` (#leader_scale)."""

PAIR_ONE_ROUND_BYTES = 1 << 20
"""With two ranks, size up to which all_reduce, broadcast and reduce_scatter send one frame each way
(#pair_one_round_bytes)."""
CROWDED_DOUBLING_BYTES = 256 << 10
"""On an oversubscribed power-of-two group, all_reduce size up to which recursive doubling runs
(#crowded_doubling_bytes)."""
CROWDED_HALVING_BYTES = 2 << 20
"""On an oversubscribed power-of-two group, all_reduce size up to which halving-doubling runs (then the ring)
(#crowded_halving_bytes)."""
CROWDED_TREE_BROADCAST_BYTES = 4 << 20
"""With more ranks than cores, broadcast size up to which the binomial tree runs (then the chain)
(#crowded_tree_broadcast_bytes)."""
DIRECT_ALL_GATHER_BYTES = 4 << 20
"""All_gather output size up to which every block goes straight to every peer over the sockets
(#direct_all_gather_bytes)."""
AUTO_INLINE_BYTES = (4 << 20, 256 << 10)
"""Default `inline_bytes` (spare, oversubscribed cores): frames written from the op's thread first
(#auto_inline_bytes)."""

ARENA_OPS = (Op.ALL_REDUCE, Op.BROADCAST, Op.ALL_GATHER, Op.REDUCE_SCATTER)
LEADER_OPS = (Op.ALL_REDUCE, Op.BROADCAST)
"""The ops a group on hosts of different sizes runs in two levels (through each host's leader); its all_gather and
reduce_scatter, whose blocks per host would differ in size, stay on the sockets."""


def mailbox_bytes(size: int) -> int:
    """Largest payload per rank through the mailbox of a group of `size` (its slots): MAILBOX_PAIR_BYTES for two,
    else MAILBOX_BYTES, less in groups so large that the mailbox would take over MAILBOX_GROUP_BYTES (whole pages),
    never under MAILBOX_MIN_BYTES."""
    per = MAILBOX_GROUP_BYTES // (2 * (size + 1)) // 4096 * 4096
    return max(MAILBOX_MIN_BYTES, min(MAILBOX_PAIR_BYTES if size == 2 else MAILBOX_BYTES, per))


def mailbox_limit(op: Op, size: int) -> int:
    """Largest payload per rank of op `op` through the mailbox of a group of `size` (a broadcast past one slot runs
    in chunks of at most a slot)."""
    slot = mailbox_bytes(size)
    if op is Op.ALL_REDUCE:
        return min(slot, MAILBOX_ALL_REDUCE_BYTES)
    return MAILBOX_BROADCAST_SLOTS * slot if op is Op.BROADCAST and size > 2 else slot


class Path(enum.Enum):
    MAILBOX = "mailbox"
    SINGLE_COPY = "single_copy"
    ARENA = "arena"
    TWO_LEVEL = "two_level"
    SOCKETS = "sockets"


class Route(NamedTuple):
    path: Path
    algorithm: str = ""
    """On the sockets: the schedule (`socket_algorithm`); else empty."""

    def __str__(self) -> str:
        return f"{self.path.value}:{self.algorithm}" if self.algorithm else self.path.value


@dataclass(frozen=True)
class Shape:
    """What a route depends on besides the op, its size and the options: the group and where its members are."""

    size: int
    oversubscribed: bool = False
    """Whether this host's ranks outnumber its cores."""
    hosts: int | None = 1
    """Hosts the members are on (None: not known yet: the members tell each other at the first op that could use
    shared memory; 0: their shared-memory settings differ, so none is used)."""
    per_host: int = 0
    """Members on each host if every host has as many (else 0); with `hosts` 1, the size."""
    largest_host: int = 0
    """Members on the host with the most (hosts of different sizes run all_reduce and broadcast in two levels
    through each host's first member where one host has two or more)."""
    ordered_stores: bool = ORDERED_STORES


def shm_min_bytes(options: TcpOptions, oversubscribed: bool, spins: bool) -> int:
    """The arena's threshold: `shm_min_bytes`, or by default MAILBOX_SYNC_MIN_BYTES if its steps synchronize through
    the mailbox (`spins`), else AUTO_MIN_BYTES (every synchronization over the sockets costs a few context switches
    on an oversubscribed host, so the path pays off only on larger ops)."""
    if options.shm_min_bytes >= 0:
        return options.shm_min_bytes
    return MAILBOX_SYNC_MIN_BYTES if spins else AUTO_MIN_BYTES[oversubscribed]


def spins(options: TcpOptions, shape: Shape) -> bool:
    """Whether a one-host group's arena synchronizes its steps through the mailbox (mapped with it where it can be)."""
    return options.shm_mailbox and shape.ordered_stores


def inline_bytes(options: TcpOptions, oversubscribed: bool) -> int:
    return options.inline_bytes if options.inline_bytes >= 0 else AUTO_INLINE_BYTES[oversubscribed]







def _path_bytes(op: Op, nbytes: int, size: int) -> int:
    """The bytes the arena and two-level thresholds are compared with: all_gather's output, else the input."""
    return nbytes * size if op is Op.ALL_GATHER else nbytes


def _large(nbytes: int, scale: int, threshold: int, options: TcpOptions, size: int) -> bool:
    return size > 1 and options.shm and nbytes >= max(1, scale * threshold)


def _mailbox(op: Op, nbytes: int, shape: Shape, options: TcpOptions) -> bool:
    if shape.size == 1 or not (options.shm and options.shm_mailbox and shape.ordered_stores):
        return False
    if shape.hosts not in (None, 1) or nbytes > mailbox_limit(op, shape.size):
        return False
    if op is Op.BARRIER:
        return True
    return nbytes > 0


def _single_copy(op: Op, nbytes: int, shape: Shape, options: TcpOptions) -> bool:
    if not options.shm_single_copy or shape.hosts not in (None, 1) or op not in ARENA_OPS:
        return False
    threshold = next((v for v in (options.shm_single_copy_min_bytes, options.shm_min_bytes) if v >= 0),
                     SINGLE_COPY_MIN_BYTES[op][shape.size > 2])
    return (_large(_path_bytes(op, nbytes, shape.size), 1, threshold, options, shape.size)
            or needs_compiled(op, nbytes, shape, options))


def compiled_single_copy(op: Op, nbytes: int, shape: Shape, options: TcpOptions) -> bool:
    """Whether op `op` on `nbytes` per rank takes the single-copy path in its compiled form where every member runs
    the compiled ops (COMPILED_SINGLE_COPY_BYTES, with the default thresholds). Not a matter of this rank's
    `shm_native`, which may differ between members: every member lists the path alike, sets it up at the same op,
    and takes it only if the set-up found every member compiled (`single_copy.SingleCopy.compiled`)."""
    windows = COMPILED_SINGLE_COPY_BYTES.get((op, shape.size > 2))
    if (windows is None or not (options.shm and options.shm_single_copy and options.shm_mailbox)
            or options.shm_single_copy_min_bytes >= 0 or options.shm_min_bytes >= 0 or not shape.ordered_stores
            or shape.size == 1 or shape.hosts not in (None, 1)):
        return False
    total = _path_bytes(op, nbytes, shape.size)
    return any(lo <= total <= hi for lo, hi in windows)


def needs_compiled(op: Op, nbytes: int, shape: Shape, options: TcpOptions) -> bool:
    """Whether op `op` on `nbytes` per rank takes the single-copy path only in its compiled form, ahead of the
    mailbox or the arena (`compiled_single_copy`, below SINGLE_COPY_MIN_BYTES): a group takes it there only if every
    member runs the compiled ops (`single_copy.SingleCopy.compiled`), else the next path."""
    return (compiled_single_copy(op, nbytes, shape, options)
            and _path_bytes(op, nbytes, shape.size) < SINGLE_COPY_MIN_BYTES[op][shape.size > 2])


def _arena(op: Op, nbytes: int, shape: Shape, options: TcpOptions) -> bool:
    if shape.hosts not in (None, 1) or op not in ARENA_OPS:
        return False
    spin = spins(options, shape)
    scale = 1
    if op is Op.ALL_REDUCE:
        scale = 1 if shape.size == 2 else 2  # on more ranks its steps synchronize twice
    elif op is Op.BROADCAST:
        scale = CROWDED_BROADCAST_ARENA_SCALE if shape.oversubscribed and spin else 2  # one message per rank
    threshold = shm_min_bytes(options, shape.oversubscribed, spin)
    return _large(_path_bytes(op, nbytes, shape.size), scale, threshold, options, shape.size)


def _two_level(op: Op, nbytes: int, shape: Shape, options: TcpOptions) -> bool:
    if op not in ARENA_OPS or shape.hosts in (0, 1):
        return False
    total = _path_bytes(op, nbytes, shape.size)
    threshold = shm_min_bytes(options, shape.oversubscribed, False)
    if not _large(total, 1, threshold, options, shape.size):
        return False
    if shape.hosts is None:
        return True  # may: the members' places decide
    if shape.per_host == 0:  # hosts of different sizes: through each host's first member ("leader")
        return (op in LEADER_OPS and shape.largest_host >= 2
                and _large(total, LEADER_SCALE[op], threshold, options, shape.size))
    if shape.per_host < 2:
        return False
    scale = 2 if op is Op.BROADCAST else 1
    if op is Op.ALL_REDUCE:
        scale = 1 if shape.per_host == 2 else 2  # a host's steps synchronize twice with more than two members
    return _large(total, scale, threshold, options, shape.size)


def candidates(op: Op, nbytes: int, shape: Shape, options: TcpOptions) -> tuple[Path, ...]:
    """The paths op `op` on `nbytes` per rank may take, best first; the last is always SOCKETS. With the hosts not
    known yet (`shape.hosts` None), any shared-memory path in the list tells the backend to learn them first."""
    paths = [path for path, fits in ((Path.MAILBOX, _mailbox), (Path.SINGLE_COPY, _single_copy), (Path.ARENA, _arena),
                                     (Path.TWO_LEVEL, _two_level)) if fits(op, nbytes, shape, options)]
    if Path.SINGLE_COPY in paths and needs_compiled(op, nbytes, shape, options):
        paths.remove(Path.SINGLE_COPY)
        paths.insert(0, Path.SINGLE_COPY)  # ahead of the mailbox, where every member runs the compiled ops
    return (*paths, Path.SOCKETS)


def socket_algorithm(op: Op, nbytes: int, size: int, oversubscribed: bool, options: TcpOptions) -> str:
    """The schedule of op `op` on `nbytes` per rank over the sockets of `size` ranks.

    all_reduce: recursive "doubling" up to `small_bytes` (auto with two ranks: PAIR_ONE_ROUND_BYTES); above, the
    `algorithm` option, where auto is the pipelined "ring" except on power-of-two groups of an oversubscribed host:
    doubling to CROWDED_DOUBLING_BYTES, then "halving_doubling" to CROWDED_HALVING_BYTES.
    broadcast: binomial "tree" up to `small_bytes` (two ranks: PAIR_ONE_ROUND_BYTES; oversubscribed:
    CROWDED_TREE_BROADCAST_BYTES); above, the pipelined "chain". reduce: a binomial "tree".
    all_gather: up to DIRECT_ALL_GATHER_BYTES of output, and always with two ranks, every block straight to every
    peer ("direct"; "exchange" when a block is over `inline_bytes`: one non-blocking loop over every socket). Above,
    a pipelined "ring"; on power-of-two groups of an oversubscribed host, recursive "doubling".
    reduce_scatter: one "direct" round up to `small_bytes` (two ranks: PAIR_ONE_ROUND_BYTES); above, recursive
    "halving" where all_reduce would use halving_doubling, else the pipelined "ring".
    """
    pow2, pair = size & (size - 1) == 0, size == 2 and nbytes <= PAIR_ONE_ROUND_BYTES
    if op is Op.ALL_REDUCE:
        return _all_reduce(nbytes, size, oversubscribed, options)
    if op is Op.REDUCE_SCATTER:
        if nbytes <= options.small_bytes or pair:
            return "direct"
        return "halving" if _all_reduce(nbytes, size, oversubscribed, options) == "halving_doubling" else "ring"
    if op is Op.BROADCAST:
        tree = nbytes <= options.small_bytes or pair or (oversubscribed and nbytes <= CROWDED_TREE_BROADCAST_BYTES)
        return "tree" if tree else "chain"
    if op is Op.ALL_GATHER:
        if size == 2 or nbytes * size <= DIRECT_ALL_GATHER_BYTES:
            return "exchange" if nbytes > inline_bytes(options, oversubscribed) else "direct"
        return "doubling" if oversubscribed and pow2 and options.algorithm == "auto" else "ring"
    return "tree" if op is Op.REDUCE else "direct"


def _all_reduce(nbytes: int, size: int, oversubscribed: bool, options: TcpOptions) -> str:
    auto, pow2 = options.algorithm == "auto", size & (size - 1) == 0
    if nbytes <= options.small_bytes or (auto and size == 2 and nbytes <= PAIR_ONE_ROUND_BYTES):
        return "doubling"
    if auto and pow2 and oversubscribed:
        if nbytes <= CROWDED_DOUBLING_BYTES:
            return "doubling"
        return "halving_doubling" if nbytes <= CROWDED_HALVING_BYTES else "ring"
    return "halving_doubling" if options.algorithm == "halving_doubling" and pow2 else "ring"


def route(op: Op, nbytes: int, shape: Shape, options: TcpOptions | None = None) -> Route:
    """The route op `op` on `nbytes` per rank takes in a group of `shape` whose shared memory maps (and whose members
    run the compiled ops unless `options.shm_native` is off)."""
    options = options or TcpOptions()
    paths = candidates(op, nbytes, shape, options)
    if paths[0] is Path.SINGLE_COPY and not options.shm_native and needs_compiled(op, nbytes, shape, options):
        paths = paths[1:]
    path = paths[0]
    if path is Path.SOCKETS:
        return Route(path, socket_algorithm(op, nbytes, shape.size, shape.oversubscribed, options))
    return Route(path)
