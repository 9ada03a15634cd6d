"""The one interface every collective backend implements (one file per backend beside this one).

A `Backend` is the communicator of one process group: ranks here are *group* ranks (0..size-1).
Arrays are NumPy (tcp) or CuPy (nccl). In-place ops write into the array given; the others
return a new array. Every call is bounded by `options.timeout` and raises `DistributedError`
(naming op, group, rank and peer) instead of hanging.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from axond.distributed.backends.tcp.options import TcpOptions
from axond.distributed.backends.tcp.transport.handshake import HANDSHAKE_TIMEOUT
from axond.distributed.reduce_op import ReduceOp
from axond.store import Store

Array = Any
"""A NumPy or CuPy ndarray."""


@dataclass(frozen=True)
class BackendOptions:
    """Settings shared by every backend of a process group."""

    timeout: float = 300.0
    """Seconds any blocking call may take before it raises `DistributedError`."""
    job_secret: bytes = b""
    """Shared secret of the job generation; peers prove they know it before any data flows."""
    host: str | None = None
    """Address to listen on and advertise (None: from AXOND_SOCKET_IFNAME, else the hostname's)."""
    device: int | None = None
    """GPU index for device backends (None: LOCAL_RANK)."""
    port: int = 0
    """Port the tcp backend listens on (0: chosen by the OS); only the default group uses it."""
    handshake_timeout: float = HANDSHAKE_TIMEOUT
    """Seconds an incoming tcp connection has, in all, to prove the job secret while a group forms; then it is dropped."""
    tcp: TcpOptions | None = None
    """The tcp backend's settings (None: `TcpOptions.from_env()` when the group is created)."""


class Backend(ABC):
    """Communicator of one process group; built by `create_backend` from the registry."""

    name: ClassVar[str]

    def __init__(self, store: Store, rank: int, size: int, group_name: str, options: BackendOptions) -> None:
        self.store = store
        """The group's namespace of the job's KV store (already prefixed by group)."""
        self.rank = rank
        self.size = size
        self.group_name = group_name
        self.options = options

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """(True, "") if this backend can run here, else (False, what is missing and what to install)."""
        return True, ""

    @abstractmethod
    def all_reduce(self, x: Array, op: ReduceOp) -> None:
        """Reduce `x` over the group, leaving the result in `x` on every rank."""

    @abstractmethod
    def broadcast(self, x: Array, src: int) -> None:
        """Copy `x` of group rank `src` into `x` on every rank."""

    @abstractmethod
    def reduce(self, x: Array, dst: int, op: ReduceOp) -> None:
        """Reduce `x` over the group into `x` on `dst`; other ranks' `x` is left unspecified but intact in shape."""

    @abstractmethod
    def all_gather(self, x: Array, out: Array | None = None) -> Array:
        """Return an array of shape (size, *x.shape) holding every rank's `x` (`out`, if given, of that shape)."""

    @abstractmethod
    def reduce_scatter(self, x: Array, op: ReduceOp, out: Array | None = None) -> Array:
        """Reduce `x` over the group and return this rank's block of x.shape[0] // size rows (into `out` if given)."""

    @abstractmethod
    def gather(self, x: Array, dst: int) -> Array | None:
        """Return (size, *x.shape) on `dst`, None elsewhere."""

    @abstractmethod
    def scatter(self, x: Array | None, src: int) -> Array:
        """`x` on `src` is (size, ...); return this rank's slice x[rank] (others pass None)."""

    @abstractmethod
    def all_to_all(self, x: Array, input_split_sizes: Sequence[int] | None = None,
                   output_split_sizes: Sequence[int] | None = None) -> Array:
        """Row block i of `x` goes to rank i; return the received blocks in rank order.

        Blocks are x.shape[0] // size rows, or `input_split_sizes[i]` rows; the received ones
        `output_split_sizes[j]` rows (None: asked from the peers). See `axond.distributed.splits`.
        """

    @abstractmethod
    def send(self, x: Array, dst: int, tag: int) -> None:
        """Send `x` to group rank `dst`."""

    @abstractmethod
    def recv(self, x: Array, src: int, tag: int) -> None:
        """Receive into `x` from group rank `src` (same shape, dtype and tag as the send)."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank of the group has entered the barrier."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets, threads and communicators; idempotent."""

    def explain_timeouts(self, describe_peer: Callable[[int], str],
                         describe_peers: Callable[[str], str] | None = None) -> None:
        """Give the backend a way to say, in a timeout's message, what the silent peers are doing.

        `describe_peer(group rank)` tells what one peer is blocked in (tcp timeouts name the peer);
        `describe_peers(op)` which members are not in `op` (an NCCL collective's timeout names none).
        The default ignores both.
        """

    def abort(self, reason: str) -> None:
        """Give up on the group because this rank failed: peers blocked on it raise instead of waiting.

        The default closes the links, which peers see as a closed connection; backends that can
        say why (tcp) send `reason` instead. The group is unusable afterwards; `close` still releases it.
        """
        self.close()

    def abort_failed(self, reason: str) -> None:
        """`abort` because this rank's process failed: `reason` ("rank R failed: ExcType: message") is the
        root cause, which peers quote as it is. The default is `abort(reason)`."""
        self.abort(reason)
