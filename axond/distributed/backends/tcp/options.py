"""Every knob of the tcp backend in one frozen dataclass; `TcpOptions.from_env` is the only reader of the environment.

A group's options are fixed when it is created: pass `BackendOptions(tcp=TcpOptions(...))` (the tcp backend's
`options_class`, checked by the registry), or leave `tcp` unset to read the AXOND_TCP_* and AXOND_SHM* variables
then. `ENVIRONMENT` lists each variable with its field, default
and meaning; docs/environment.md has the same table (a test checks it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Literal

from axond.config import RuntimeEnv
from axond.distributed.backends.tcp.transport.handshake import HANDSHAKE_TIMEOUT
from axond.distributed.backends.tcp.transport.sockets import CONGESTION, CONGESTION_NAME, RTO_MAX_MS, RTO_MAX_RANGE
from axond.env_flags import parse_flag

Algorithm = Literal["auto", "ring", "halving_doubling"]
ALGORITHMS: tuple[Algorithm, ...] = ("auto", "ring", "halving_doubling")
NON_NEGATIVE = ("small_bytes", "chunk_bytes", "shm_arena_bytes")
NOT_FROM_ENV = ("oversubscribed", "local_ranks", "port", "handshake_timeout")
"""Fields no AXOND_TCP_*/AXOND_SHM* variable sets: detected when the group forms, or given in code."""
LARGEST = float(1 << 40)
"""The largest value any AXOND_TCP_*/AXOND_SHM* number may have (a TiB, or that many microseconds)."""
AUTO = ("spin_us", "shm_poll_us", "inline_bytes", "shm_min_bytes", "shm_single_copy_min_bytes", "socket_buffer_bytes")
"""Fields whose negative default means "auto" (the environment may also say `auto`)."""


@dataclass(frozen=True)
class TcpOptions:
    """How a tcp group moves data. Negative sizes and times mean "auto" (see `policy`)."""

    small_bytes: int = 128 << 10
    """All-reduce and broadcast up to this size use latency-optimal trees; above, pipelined rings and chains."""
    chunk_bytes: int = 0
    """Pipeline chunk size (0: a quarter of a block, clamped to 64 KiB..1 MiB)."""
    spin_us: float = -1.0
    """Microseconds a small receive busy-polls before blocking (0: never; < 0: 50 unless the host is oversubscribed)."""
    spin_yield: bool = True
    """Yield the CPU between polls (helps when ranks outnumber cores)."""
    inline_bytes: int = -1
    """Frames up to this size are first written without blocking from the op's thread (< 0: by oversubscription)."""
    socket_buffer_bytes: int = -1
    """Send and receive buffer of each socket (0: the kernel's autotuning; < 0: auto, see
    `policy.socket_buffer_bytes`). The kernel caps a set size at net.core.wmem_max / rmem_max."""
    rto_max_ms: int = RTO_MAX_MS
    """The most milliseconds the kernel waits between retransmissions on each socket (0: the kernel's own, 120 s):
    after a flapping link is steady again, traffic resumes within about this long (see `sockets.bound_rto`)."""
    congestion: str = CONGESTION
    """Each socket's congestion control: "system" (the kernel's default) or a name the kernel offers (cubic, reno,
    bbr); see `sockets.set_congestion` for the trade-off after a lossy spell."""
    algorithm: Algorithm = "auto"
    """All-reduce above `small_bytes`: "ring", "halving_doubling" (power-of-two groups) or "auto" (see `policy`)."""
    shm: bool = True
    """Use shared memory between the ranks of one host (False: everything through the sockets, as across hosts)."""
    shm_min_bytes: int = -1
    """Ops from this size go through shared memory: the single-copy path or the arena (< 0: auto, per path, see
    `policy.shm_min_bytes` and `policy.SINGLE_COPY_MIN_BYTES`)."""
    shm_arena_bytes: int = 32 << 20
    """Size of a group's arena; its slots (2 x (ranks + 1)) are the pipeline chunks of the path."""
    shm_mailbox: bool = True
    """Small ops of a group on one host through its shared mailbox (waits spin, yielding the CPU)."""
    shm_poll_us: float = -1.0
    """Microseconds a compiled mailbox wait polls the members' posts before it blocks until a post wakes it (0: block
    at once; < 0: auto, see `policy.mailbox_poll_seconds`)."""
    shm_native: bool = True
    """Repeated small mailbox ops run in axond's compiled helper where the install built it (False: in Python; both
    speak the same protocol, so ranks may differ)."""
    shm_single_copy: bool = True
    """Large ops of a group on one host read the peers' buffers directly (process_vm_readv: one copy per byte) where
    every member can; else (or False) through the arena (two copies)."""
    shm_single_copy_min_bytes: int = -1
    """Ops from this size (all_gather: of the output) take the single-copy path (< 0: `shm_min_bytes` where set, else
    `policy.SINGLE_COPY_MIN_BYTES` by op and group size). Jobs whose large buffers all come from `axond.shared_empty`
    gain from 2 MiB (docs/collectives.md)."""
    oversubscribed: bool | None = None
    """Whether this host's ranks outnumber its cores (None: detected when the group forms); it picks algorithms."""
    local_ranks: int = 0
    """Ranks of the job on this host, if known (LOCAL_WORLD_SIZE): the detection counts at least these."""
    port: int = 0
    """Port this member listens on (0: chosen by the OS); only the default group uses it (`for_new_group`)."""
    handshake_timeout: float = HANDSHAKE_TIMEOUT
    """Seconds an incoming connection has, in all, to prove the job secret while a group forms; then it is dropped."""

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r}: use auto, ring or halving_doubling")
        for name in NON_NEGATIVE:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.rto_max_ms != 0 and not RTO_MAX_RANGE[0] <= self.rto_max_ms <= RTO_MAX_RANGE[1]:
            raise ValueError(f"rto_max_ms={self.rto_max_ms}: use 0 (the kernel's own) or "
                             f"{RTO_MAX_RANGE[0]}..{RTO_MAX_RANGE[1]} milliseconds")

        if self.congestion != "system" and not CONGESTION_NAME.fullmatch(self.congestion):
            raise ValueError(f"congestion={self.congestion!r}: use system or a congestion control's name "
                             "(cubic, reno, bbr: lower-case, at most 15 characters)")

    def for_new_group(self) -> TcpOptions:
        """These options for a group made by `new_group`: any free port (the fixed one is the default group's)."""
        return replace(self, port=0) if self.port else self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TcpOptions:
        """The options the AXOND_TCP_* and AXOND_SHM* variables of `environ` (a group's `RuntimeEnv.environ`; default:
        this process's environment, read by `RuntimeEnv.from_env`) set, with
        LOCAL_WORLD_SIZE (set by launchers) as `local_ranks`; ValueError naming the variable and what it accepts for a
        bad value."""
        env = RuntimeEnv.from_env().environ if environ is None else environ
        values: dict[str, object] = {}
        local = env.get("LOCAL_WORLD_SIZE", "").strip()
        if local.isdigit():
            values["local_ranks"] = int(local)
        for var, (field, _, _) in ENVIRONMENT.items():
            raw = env.get(var)
            if raw is not None and raw.strip() != "":
                values[field] = _parse(var, field, raw.strip())
        return cls(**values)  # type: ignore[arg-type]


ENVIRONMENT: dict[str, tuple[str, str, str]] = {
    "AXOND_SHM": ("shm", "1", "shared memory between the ranks of one host (0: sockets only)"),
    "AXOND_SHM_MAILBOX": ("shm_mailbox", "1", "small ops of a one-host group through a shared mailbox"),
    "AXOND_SHM_NATIVE": ("shm_native", "1", "repeated small mailbox ops in the compiled helper (0: in Python)"),
    "AXOND_SHM_POLL_US": ("shm_poll_us", "auto", "microseconds a mailbox wait polls before it blocks"),
    "AXOND_SHM_MIN_BYTES": ("shm_min_bytes", "auto", "ops from this size go through the arena"),
    "AXOND_SHM_SINGLE_COPY": ("shm_single_copy", "1", "large ops on one host read peers' buffers directly (one copy)"),
    "AXOND_SHM_SINGLE_COPY_MIN_BYTES": ("shm_single_copy_min_bytes", "auto",
                                        "ops from this size read peers' buffers directly"),
    "AXOND_SHM_ARENA_BYTES": ("shm_arena_bytes", "33554432", "size of a group's shared-memory arena"),
    "AXOND_TCP_SMALL_BYTES": ("small_bytes", "131072", "all_reduce/broadcast up to this size use trees"),
    "AXOND_TCP_CHUNK_BYTES": ("chunk_bytes", "0", "pipeline chunk size (0: auto, 64 KiB..1 MiB)"),
    "AXOND_TCP_SPIN_US": ("spin_us", "auto", "microseconds a small receive busy-polls (0: never)"),
    "AXOND_TCP_SPIN_YIELD": ("spin_yield", "1", "yield the CPU between polls"),
    "AXOND_TCP_INLINE_BYTES": ("inline_bytes", "auto", "frames up to this size are written from the op's thread"),
    "AXOND_TCP_SOCKET_BUFFER_BYTES": ("socket_buffer_bytes", "auto",
                                      "each socket's send and receive buffer (0: the kernel's autotuning)"),
    "AXOND_TCP_RTO_MAX_MS": ("rto_max_ms", str(RTO_MAX_MS),
                             "most milliseconds between retransmissions (0: the kernel's own, 120 s)"),
    "AXOND_TCP_CONGESTION": ("congestion", CONGESTION,
                             "each socket's congestion control: system (the kernel's default) or a name"),
    "AXOND_TCP_ALGORITHM": ("algorithm", "auto", "large all_reduce: auto, ring or halving_doubling"),
}
"""variable -> (TcpOptions field, its default as docs/environment.md writes it: "auto" for a negative one, meaning)."""


def _parse(var: str, field: str, raw: str) -> object:
    kind = {f.name: f.type for f in fields(TcpOptions)}[field]
    if kind == "bool":
        return parse_flag(var, raw)
    if field == "congestion":
        if raw != "system" and not CONGESTION_NAME.fullmatch(raw):
            raise ValueError(f"bad {var}={raw[:40]!r}: use system or a congestion control's name (cubic, reno, bbr)")
        return raw
    if kind == "Algorithm":
        if raw not in ALGORITHMS:
            raise ValueError(f"bad {var}={raw!r}: use auto, ring or halving_doubling")
        return raw
    if raw.lower() == "auto" and field in AUTO:
        return -1 if kind == "int" else -1.0
    value: float
    try:
        if kind == "int":
            value = int(raw) if len(raw) <= 40 else math.nan
        else:
            value = float(raw)
    except ValueError:
        value = math.nan
    if not abs(value) <= LARGEST:  # nan and inf too
        raise ValueError(f"bad {var}={raw[:40]!r}: use a number" + (" of bytes" if kind == "int" else "")
                         + f" up to {LARGEST:.0f}" + (" (or auto)" if field in AUTO else ""))
    if field in NON_NEGATIVE and value < 0:
        raise ValueError(f"bad {var}={raw!r}: must not be negative")
    if field == "rto_max_ms" and value != 0 and not RTO_MAX_RANGE[0] <= value <= RTO_MAX_RANGE[1]:
        raise ValueError(f"bad {var}={raw!r}: use 0 (the kernel's own) or {RTO_MAX_RANGE[0]}..{RTO_MAX_RANGE[1]}")
    return value
