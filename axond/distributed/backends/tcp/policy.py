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
"""

from __future__ import annotations

import enum
import platform
from dataclasses import dataclass
from typing import NamedTuple

from axond.distributed.backends.tcp.options import TcpOptions
from axond.distributed.backends.tcp.transport.wire import Op

ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
"""Whether stores become visible to other cores in program order (x86's TSO), which the mailbox relies on."""

MAILBOX_BYTES = 256 << 10
"""Largest payload per rank that goes through the mailbox (all_gather: one block; reduce_scatter: the input) in groups
of 3 to 5 ranks, less in larger ones (`mailbox_bytes`); two ranks: MAILBOX_PAIR_BYTES. With the compiled prepared
ops, against 64 KiB (the arena above it; bench/compare_trees.py, 3 rounds, best of the rounds' medians, session 16),
128 and 256 KiB: at 2 ranks all_gather 0.92 / 0.59x the time, broadcast 0.68 / 0.56, reduce_scatter 0.56 / 0.69, all_reduce 0.76 / 1.09 (the arena's pair all_reduce
splits the reduction); at 4 ranks all_reduce 0.57 / 0.65, broadcast 0.54 / 0.68, reduce_scatter 0.39 / 0.46,
all_gather 1.10 / 0.99. Earlier, against 4 KiB, 8-64 KiB:
all_reduce 0.22-0.49x the time at 2 ranks, 0.34-0.67x at 4 (a small all_reduce runs prepared); broadcast 0.61-0.84x
at 2; all_gather and reduce_scatter 0.77-0.94x at 2, 0.54-0.92x at 4 (bench/RESULTS.md, session 13). On a host whose
ranks outnumber its cores broadcast takes it too, against the socket tree (prepared, two interleaved A/Bs at 3 and 4
ranks on 2 cores, 8 B-64 KiB): 0.44-0.95x the time, 0.26-0.61x at 64 KiB (session 14)."""
MAILBOX_PAIR_BYTES = 512 << 10
"""Largest payload per rank through the mailbox of two ranks, all_reduce at most MAILBOX_ALL_REDUCE_BYTES. 512 KiB
against 256 KiB (the arena above it; bench/compare_trees.py, 4 rounds, median / best of the rounds' medians, session
18): at 2 ranks broadcast 304 KiB 0.72 / 0.80x the time, 384 KiB 0.60 / 0.68 and 0.72 / 0.81, 512 KiB 0.45 / 0.49;
reduce_scatter 304 KiB 0.67 / 0.65, 384 KiB 0.66 / 0.67 and 0.28 / 0.63, 512 KiB 0.68 / 0.68; all_gather of 768 KiB /
1 MiB output 0.69 / 0.67, 0.73 / 0.72; ops that took the mailbox before 0.96-1.02 (best). But all_reduce at 2 ranks
384 KiB 1.44 / 1.43, 512 KiB 1.71 / 1.78 (3 rounds; the arena's pair all_reduce splits the reduction): it stays at
256 KiB. Four ranks with 304 KiB slots (what 3 MiB allows) gained at 304 KiB (broadcast 0.58 / 0.57, reduce_scatter
0.55 / 0.47, all_gather of 1216 KiB output 0.69 / 0.69), but their all_reduce of 64 KiB-1 MiB ran 1.13-1.45x slower
(best of two 4-round A/Bs), so groups of more than two keep MAILBOX_BYTES."""
MAILBOX_ALL_REDUCE_BYTES = 256 << 10
"""Largest all_reduce payload per rank through the mailbox (see MAILBOX_PAIR_BYTES)."""
MAILBOX_MIN_BYTES = 4 << 10
MAILBOX_GROUP_BYTES = 3 << 20
"""The most /dev/shm a group's mailbox takes (two buffers of size + 1 slots) before its slots shrink."""


def mailbox_bytes(size: int) -> int:
    """Largest payload per rank through the mailbox of a group of `size` (its slots): MAILBOX_PAIR_BYTES for two,
    else MAILBOX_BYTES, less in groups so large that the mailbox would take over MAILBOX_GROUP_BYTES (whole pages),
    never under MAILBOX_MIN_BYTES."""
    per = MAILBOX_GROUP_BYTES // (2 * (size + 1)) // 4096 * 4096
    return max(MAILBOX_MIN_BYTES, min(MAILBOX_PAIR_BYTES if size == 2 else MAILBOX_BYTES, per))


MAILBOX_BROADCAST_SLOTS = 24
"""A broadcast of a group of more than two ranks goes through the mailbox up to this many slots' worth (6 MiB at 3-5
ranks), in chunks of at most a slot, each one mailbox round (`mailbox_ops.broadcast_chunks`): the root posts chunk
k + 1 in the other buffer while the others copy chunk k out, and the rounds run in C without the arena's per-step
Python. bench/compare_trees.py, 4 rounds, best of the rounds' medians, 4 ranks on 2 cores, inputs unchanged / written
before every call (`--fresh-inputs`): 4 slots and the homes of `spread` against the arena without them 0.29-0.53 at
384 KiB-1 MiB (unchanged); 16 slots against 4 (the arena above) at 1.5-4 MiB 0.53-0.59 / 0.51-0.61; 24 against 16
at 5 and 6 MiB 0.77 and 0.93 / 0.62 and 0.64; 32 against 24 at 8 MiB 1.14 / 0.63 (so not there). 3 ranks, against
the arena: 384 KiB-4 MiB 0.37-0.56, 6 MiB 0.96 (unchanged inputs)."""


def mailbox_limit(op: Op, size: int) -> int:
    """Largest payload per rank of op `op` through the mailbox of a group of `size` (a broadcast past one slot runs
    in chunks of at most a slot)."""
    slot = mailbox_bytes(size)
    if op is Op.ALL_REDUCE:
        return min(slot, MAILBOX_ALL_REDUCE_BYTES)
    return MAILBOX_BROADCAST_SLOTS * slot if op is Op.BROADCAST and size > 2 else slot


AUTO_MIN_BYTES = (64 << 10, 256 << 10)
"""Default `shm_min_bytes` with (spare, oversubscribed) cores where the arena's steps synchronize over the sockets
(groups of several hosts, no mailbox); all_reduce on more than two ranks and broadcast take twice that. Measured on
2 cores, shared memory against sockets: at 2 ranks, reduce_scatter 32 KiB 47 / 43 us, 256 KiB 82 / 129 us; broadcast
32 KiB 32 / 20 us, 256 KiB 50 / 60 us. At 4 ranks, all_reduce 256 KiB 467 / 454 us, 512 KiB 657 / 1022 us; broadcast
256 KiB 262 / 179 us; all_gather 256 KiB 350 / 725 us."""
MAILBOX_SYNC_MIN_BYTES = 4 << 10
"""Default `shm_min_bytes` of a group whose arena steps synchronize through its mailbox (one host, x86, mailbox on):
every op the mailbox does not take (all_reduce on more than two ranks and broadcast from twice that; broadcast on an
oversubscribed host from 16 times, 64 KiB, as the socket tree's root need not wait for the others). Interleaved A/B on
2 cores, arena against sockets, 8 and 32 KiB: at 2 ranks all_reduce 15-22 / 35-39 us and 23-24 / 40-46 us,
reduce_scatter 22-29 / 29-36 us and 26-28 / 40-44 us; at 4 ranks all_reduce 129-161 / 164-196 us (8 KiB),
reduce_scatter 98-111 / 247-307 us and 74-120 / 248-265 us, all_gather 32 KiB 65-102 / 239-283 us; broadcast at
4 ranks 59-74 / 47-57 us (8 KiB), 51-81 / 51-61 us (16 KiB), 56-88 / 81-88 us (64 KiB)."""
SINGLE_COPY_MIN_BYTES: dict[Op, tuple[int, int]] = {
    Op.ALL_GATHER: (8 << 20, 8 << 20), Op.BROADCAST: (16 << 20, 16 << 20), Op.REDUCE_SCATTER: (4 << 20, 16 << 20),
    Op.ALL_REDUCE: (1 << 62, 16 << 20)}
"""Default size (all_gather: of the output) from which an op of a one-host group of (two, more) ranks takes the
single-copy path instead of the arena, where every member can read the others' memory (an explicit `shm_min_bytes`
replaces it). A two-rank all_reduce never takes it by default: the arena's, in STEP_BYTES steps, beats it at
every size measured. A process_vm_readv costs ~10 us a call and copies at 5-11 GB/s where a memcpy of cache-resident data
runs at 20-25, so one copy wins only once the arena's two spill out of the caches. Single copy / arena time on
2 cores (the 4 ranks oversubscribed), from five interleaved A/B runs (three of bench/compare_trees.py, 4 rounds;
two alternating the paths call by call in one job; bench/RESULTS.md, session 11); the spread is the machine's
(other jobs ran): broadcast 16 MiB 0.61-0.78 at 2 ranks, 0.58-0.86 at 4 (once 1.28), 64 MiB 0.43-0.92 / 0.40-0.84,
1 MiB 0.73-1.29 / 1.16-1.83; reduce_scatter 16 MiB 0.48-0.85 (once 1.18) / 0.56-0.89 (once 1.04), 64 MiB
0.33-0.79 / 0.31-0.73, 4 MiB 0.73-0.77 / 0.89-1.30; all_reduce 16 MiB 0.77-0.84 in the one-job runs but 1.27-1.41
in the first two tree runs at 2 ranks, 0.65-1.01 at 4, 64 MiB 0.61-0.73 (tree runs 1.08-1.24, then 0.72) /
0.60-0.95, 4 MiB 0.95-1.25 / 1.27-1.38; all_gather 16 MiB 0.55-0.95 but 1.73-1.81 in one one-job run at 2 ranks,
0.56-1.69 at 4, 64 MiB 0.57-0.84 / 0.75-1.00 (once 1.47), 1 MiB 1.16-1.32 / 1.15-1.75. all_reduce of 2 ranks from
4 MiB (session 12, a quiet machine, compare_trees 4 rounds, median / best of rounds): 2 MiB 1.74 / 1.74 (so not
there), 4 MiB 0.85 / 0.66 and 0.73 / 0.62, 6 MiB 0.74 / 0.61 and 0.59 / 0.79, 8 MiB 0.87 / 0.82, 12 MiB 0.92 / 0.76,
16 MiB 0.82 / 0.82, 24 MiB 0.90 / 0.89; rows with the same path on both sides read 0.77-0.99. Two ranks, all_gather
from 8 MiB of output and reduce_scatter from 4 MiB (session 12, two A/Bs each): all_gather 8 MiB 0.75 / 0.43 and
0.75 / 0.60, 16 MiB 0.63 / 0.61 and 0.68 / 0.64 (4 MiB 1.17 / 0.92: not there); reduce_scatter 4 MiB 0.76 / 0.74
and 0.74 / 0.85, 8 MiB 0.70 / 0.61 and 0.77 / 0.75 (2 MiB: same path, 1.32 / 1.27); broadcast stays at 16 MiB
(4 MiB 1.30 / 1.39, 8 MiB 0.96 / 1.13). all_reduce of 2 ranks from 6 MiB since session 17, against the arena
synchronized through the mailbox (three alternating rounds of bench/collectives.py, the cross-core probe fast
before each): 4 MiB 1.07-1.14, 5 MiB 1.19-1.37, 6 MiB 0.98-1.13, 7 MiB 0.79-0.90; in a DDP step (the 4.2 MB
gradient bucket, out of the caches) 0.91-1.28 ms against 0.76-0.89 ms. all_gather of more than two ranks from 8 MiB
of output since session 17, once the peers read each rank's input itself (4 ranks on 2 cores, bench/compare_trees.py,
4 rounds, median / best): 4 MiB 0.41 / 0.70, 8 MiB 0.51 / 0.56, 16 MiB 0.54 / 0.55; but where the input is the
rank's row of the output (torch FSDP2's all-gathers), which the peers read as it was just written, single copy /
arena at 4 ranks: 4 MiB 646-1487 / 461-660 us, 8 MiB 1352-1504 / 2309-2419, 16 MiB 2981-3304 / 4086-4920."""
COMPILED_SINGLE_COPY_BYTES: dict[tuple[Op, bool], tuple[tuple[int, int], ...]] = {
    (Op.BROADCAST, False): ((8 << 20, 1 << 62),),
    (Op.ALL_GATHER, False): ((4 << 20, 1 << 62),),
    (Op.ALL_GATHER, True): ((2 << 20, 1 << 62),),
}
"""Sizes (all_gather: of the output; from, to) at which an op of a one-host group of (two: False, more: True) ranks
takes the single-copy path in its compiled form (`_fastbox`: one C call publishes, reads with process_vm_readv and
synchronizes; a two-rank broadcast's root writes half of the other rank's buffer meanwhile), ahead of the mailbox or
the arena, where every member runs the compiled ops. Kept where it won both with unchanged inputs and with inputs
written before every call (`bench/collectives.py --fresh-inputs`, as in training); bench/compare_trees.py, 3-4
rounds, median / best of the rounds' medians, after / before, session 19:

- all_gather, two ranks: unchanged 4 MiB 0.77 / 0.89, 8 MiB 0.81 / 0.93, 64 MiB 0.89 / 0.90 (its own block with
  `rep movsb`, as the Python path); fresh 4 MiB 0.86 / 0.88, 16 MiB 0.88 / 0.91, 64 MiB 0.74 / 0.61. Not 1 MiB (1.01
  / 1.16), nor 128-512 KiB once the mailbox's compiled post skips unchanged blocks: the mailbox against the single
  copy there, unchanged 0.51-0.74, fresh 1.10-1.14 at 128-256 KiB and 0.74 at 512 KiB (4 rounds).
- all_gather, four ranks (on 2 cores): unchanged 2 MiB 0.25 / 0.76, 4 MiB 0.32 / 0.40, 8 MiB 0.96 / 0.77, 32 MiB
  0.72 / 0.99; fresh 4 MiB 0.38 / 0.55, 16 MiB 0.62 / 0.77, 64 MiB 1.07 / 0.99; where the input is the rank's row of
  the output, written before each call (torch FSDP2's all-gathers), 2 MiB 443-538 against 518-557 us, 4 MiB 463-502
  against 1002-1380, 8 MiB 973-1083 against 1548-1659. Not 64 KiB-1 MiB (1.09-1.88).
- broadcast, two ranks: unchanged 8 MiB 0.77 / 0.78, 16 MiB 0.52 / 0.50, 32 MiB 0.55 / 0.53, 64 MiB 0.57 / 0.58, 256
  MiB 0.54 / 0.54; fresh 8 MiB 0.47 / 0.31, 16 MiB 0.80 / 0.60 and 0.82 / 0.76, 64 MiB 0.82 / 0.69. Not 48-256 KiB:
  unchanged 0.45-0.87, but fresh 1.49-2.04 / 2.10-2.42 (also without the split: 1.66-2.05 best), the kernel's copy
  slower than the mailbox's where the root's data was just written; nor 4 MiB (unchanged 0.93, fresh 0.88-1.80).
- broadcast, four ranks: unchanged 384 KiB-8 MiB 0.58-0.87, but fresh 512 KiB-2 MiB 1.05-1.38: not taken.
"""
STEP_BYTES = 1 << 20
"""Bytes per step of an all_reduce (and a two-rank broadcast from PAIR_BROADCAST_STEP_MIN_BYTES) through the arena;
other ops take a whole slot (up to 4 MiB) per step. In 1 MiB steps each step's data stays in the cores' 2 MiB L2 caches
between the copy in and the reduction or copy out, and a broadcast's root copies step k + 1 in while the other rank
copies step k out. Measured on 2 cores (session 20), 1 MiB steps against whole slots:

- bench/compare_trees.py, 4 rounds, median / best of the rounds' medians: all_reduce with unchanged inputs 3 MiB
  0.82 / 0.87, 4 MiB 0.64 / 0.65, 1-2 MiB 0.96-1.01; with inputs written before every call (`--fresh-inputs`) 3 MiB
  0.89 / 0.88, 4 MiB 0.78 / 0.67. broadcast unchanged 4 MiB 0.99 / 1.00, 6 MiB 0.78 / 0.81; fresh 4 MiB 0.89 / 0.82,
  6 MiB 0.65 / 0.68; at 2-3 MiB fresh 0.68-0.80 / 0.90-0.99 but unchanged 1.08-1.10 (so not there).
- Interleaved in one job (six rounds, inputs written before every call, median of the rounds): all_reduce 4 MiB
  0.68 (512 KiB steps 0.76, 2 MiB steps 0.71); broadcast 4 MiB 0.60.
- Against the single-copy path (which took a pair's all_reduce from 6 MiB before): the arena's all_reduce in 1 MiB
  steps in 0.71-0.73 the time at 6 MiB, 0.72-0.78 at 8 MiB, 0.75 at 16 MiB, 0.79 at 64 MiB, 0.85 at 256 MiB (in one
  job); compare_trees unchanged 6 MiB 0.74 / 0.71, 8 MiB 0.72 / 0.73. So a pair's all_reduce stays on the arena
  (SINGLE_COPY_MIN_BYTES). A two-rank broadcast from 8 MiB keeps the compiled single copy, in 0.60-0.80 the time of
  the arena's 1 MiB steps.
- More ranks: at 4 ranks on 2 cores 1 MiB steps took the all_reduce of 2-8 MiB 1.22-1.48x the time while each step's
  synchronization ran in Python (session 20); since it is one C call (`arena_ops.Sync`), 0.69-0.71 (unchanged inputs)
  and 0.74-0.83 (`--fresh-inputs`) at 2-8 MiB, best of four compare_trees rounds; in one job 0.80-0.91 back to back
  (x at page offsets 64 and 320 too), 0.87-1.07 with a barrier and a fill before each call; 3 ranks 0.80-0.99;
  torch's DDP step with one 4.2 MB bucket level. Where each call's input was first copied in from another array in
  one job, 0.91-1.56 (bench/RESULTS.md, session 21)."""
PAIR_BROADCAST_STEP_MIN_BYTES = 4 << 20
TWO_LEVEL_STEP_BYTES = 1 << 20
"""Bytes per step of a host's part of an op in two levels (`hierarchy.two_level`; else a whole slot of the host's
arena, 4 MiB with two members). Two namespace hosts of two ranks each on 2 cores (`bench/collectives.py --hosts 2
--ranks-per-host 2 --fresh-inputs`, three interleaved A/Bs of 3-6 rounds, session 20; 1 MiB steps / whole slots,
median of the rounds; the first two through a smaller arena): all_reduce 4 MiB 0.87-0.91, 16 MiB 0.81-0.95, 64 MiB
0.88-0.89; broadcast 4-16 MiB 0.81-0.98 (64 MiB 1.02-1.11); all_gather 16 MiB 0.89-0.90 (4 and 64 MiB 0.94-1.07);
reduce_scatter 4 MiB 0.77-0.95, 16 MiB 0.91-0.92, 64 MiB 0.82-0.92. Steps of 2 MiB gained about as much on all_reduce
(0.88-0.91). This tree against the last one, six rounds: all_reduce 1-64 MiB 0.85-0.91, reduce_scatter 4-64 MiB
0.79-0.88, broadcast 0.87-1.01, all_gather 0.96-1.06."""
CROWDED_BROADCAST_ARENA_SCALE = 16
"""On an oversubscribed host with a mailbox, broadcast takes the arena from 16 x `shm_min_bytes` (64 KiB; in groups
whose mailbox takes more, from past the mailbox)."""
CROWDED_DOUBLING_BYTES = 256 << 10
"""With more ranks than cores on a power-of-two group, all-reduces up to this size use recursive doubling..."""
CROWDED_HALVING_BYTES = 2 << 20
"""...and up to this size halving-doubling: log2(n) pairwise steps keep the cores busier than a ring's
n-1 dependent ones (bench busbw at n = 4 on 2 cores: 1.3-1.6x the ring's from 256 KiB to 2 MiB, no gain at 4 MiB)."""
DIRECT_ALL_GATHER_BYTES = 4 << 20
"""Output size up to which all_gather sends every block straight to every peer instead of around a ring."""
CROWDED_TREE_BROADCAST_BYTES = 4 << 20
"""With more ranks than cores, broadcasts up to this size use the binomial tree, not the pipelined chain: the
same bytes in fewer, larger frames and a shallower critical path (A/B on 2 cores: 1.3-1.5x at 1 MiB and
1.2-1.4x at 4 MiB with 3 and 4 ranks; the chain wins from 16 MiB)."""
PAIR_ONE_ROUND_BYTES = 1 << 20
"""With two ranks, all_reduce, broadcast and reduce_scatter up to this size send one frame each way (recursive
doubling, one send, one direct round) instead of a pipelined ring or chain: two ranks have one hop, so the
chunks only add calls (interleaved A/B at n = 2: 1.3-1.6x at 256 KiB, 1.05-1.6x at 1 MiB; the ring wins from 2 MiB)."""
AUTO_INLINE_BYTES = (4 << 20, 256 << 10)
"""Default `inline_bytes` with (spare, oversubscribed) cores: frames up to this size are first written without
blocking from the op's thread. With a core per rank, writing from the op's thread beats waking the sender thread;
with more ranks than cores, the sender thread keeps the op's thread receiving and reducing while the write waits."""
SOCKET_BUFFER_BYTES = 4 << 20
"""Auto `socket_buffer_bytes` where the kernel lets a process set it (net.core.rmem_max and wmem_max at least
this), else the kernel's autotuning: a larger request is capped at those limits (212992 on a stock kernel) and turns
the socket's autotuning off. Two ranks over loopback sockets (AXOND_SHM=0, three alternating runs of
bench/collectives.py, session 18), busbw: with the limits at 4 MiB, 4 MiB buffers against autotuning 1.02-1.16x
from 1 MiB (broadcast 1.8-2.7x, its chain's frames wait less for the reader); with a stock kernel's limits, the
capped request against autotuning 0.36-0.84x for all_reduce, all_gather and reduce_scatter of 1-16 MiB (broadcast
0.93-1.05). Between two namespace hosts (four alternating runs) 4 MiB and autotuning are level (0.84-1.13)."""
AUTO_SPIN_SECONDS = 50e-6
"""Default busy-poll time of small receives when this host's ranks do not outnumber its cores (else none)."""


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


def socket_buffer_bytes(options: TcpOptions, limit: int) -> int:
    """Each socket's buffer size (0: the kernel's autotuning) on a host that lets a process set at most `limit`
    (`sockets.buffer_limit`)."""
    if options.socket_buffer_bytes >= 0:
        return options.socket_buffer_bytes
    return SOCKET_BUFFER_BYTES if limit >= SOCKET_BUFFER_BYTES else 0


def spin_seconds(options: TcpOptions, oversubscribed: bool) -> float:
    if options.spin_us >= 0:
        return options.spin_us * 1e-6
    return 0.0 if oversubscribed else AUTO_SPIN_SECONDS


def arena_step(op: Op, nbytes: int, size: int) -> int:
    """Bytes per step of op `op` on `nbytes` per rank through the arena of a one-host group of `size` (0: a whole
    slot): STEP_BYTES for an all_reduce, and for a two-rank broadcast from PAIR_BROADCAST_STEP_MIN_BYTES."""
    if op is Op.ALL_REDUCE or (size == 2 and op is Op.BROADCAST and nbytes >= PAIR_BROADCAST_STEP_MIN_BYTES):
        return STEP_BYTES
    return 0


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


ARENA_OPS = (Op.ALL_REDUCE, Op.BROADCAST, Op.ALL_GATHER, Op.REDUCE_SCATTER)
LEADER_OPS = (Op.ALL_REDUCE, Op.BROADCAST)
"""The ops a group on hosts of different sizes runs in two levels (through each host's leader); its all_gather and
reduce_scatter, whose blocks per host would differ in size, stay on the sockets."""
LEADER_SCALE = {Op.ALL_REDUCE: 2, Op.BROADCAST: 4}
"""Hosts of different sizes take the leaders' two levels from this many times `shm_min_bytes` (with the ranks
outnumbering the cores: all_reduce from 512 KiB, broadcast from 1 MiB). Simulated nodes on loopback (2 cores,
`bench/collectives.py --nproc 3|5 --nodes 2 --repeat 3 --peers sockets`: hosts of 2 + 1 and 3 + 2 members), two
levels / flat over the sockets, busbw: all_reduce 512 KiB 1.41 / 1.69x, 1 MiB 1.48-1.57 / 1.46-1.55x, 2 MiB
1.98 / 1.26x, 4-16 MiB 1.00-1.04 / 1.26-1.43x; broadcast 512 KiB 0.99 / 1.18x, 1 MiB 0.77-2.23 / 1.76-1.79x, 2 MiB
1.25 / 2.27x, 4-16 MiB 1.28-1.31 / 1.91-2.04x. Between real hosts the leaders' level also carries fewer bytes
across than a flat ring or chain (each host sends and receives the data once)."""


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
