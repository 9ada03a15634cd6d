"""The one interface every collective backend implements (one module or package per backend beside this one).

A `Backend` is the communicator of one process group: ranks here are *group* ranks (0..size-1).
Arrays are NumPy (tcp) or CuPy (nccl). In-place ops write into the array given; the others
return a new array. Every call is bounded by `options.timeout` and raises `DistributedError`
(naming op, group, rank and peer) instead of hanging.

Besides the ops, three capabilities have defaults a backend may override: `post_send` (an isend that
returns once the data is handed over), `start` (async ops whose completion the backend tracks itself)
and `batch_p2p` (a batch of isends and irecvs in one launch); `prepared` hands the group's fast path the prepared form
of a blocking op it just ran (`axond.distributed.fast_path`). A backend declares its own options class
(`options_class`); the registry checks them. `op_methods` names the method of every op `ProcessGroup` runs; besides
those it calls only `start`, `prepared`, `explain_timeouts`, `abort` and `close`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

from axond.config import RuntimeEnv
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.work import PendingSend
from axond.errors import DistributedError
from axond.store import Store

Array = Any
"""A NumPy or CuPy ndarray."""


MISSED: Any = type("Missed", (), {"__repr__": lambda self: "MISSED", "__slots__": ()})()
"""What a prepared runner (`Backend.prepared`) returns having done nothing: the op then takes the full way."""

Signature = tuple[str, Any, Any, Any]
"""What a prepared form of a blocking op is made for: (op name, dtype, element count, the op's scalar argument: its
ReduceOp, root, or None); (op name, None, None, None) for a barrier. A runner checks what else it needs of the shape."""


def signature(op: str, x: Any, arg: Any) -> Signature:
    """The signature of blocking op `op` on NumPy array `x` (None: a barrier) with scalar argument `arg`: the key of a
    prepared form on both sides (`Backend.prepared` and the group's `axond.distributed.fast_path`)."""
    return (op, None, None, None) if x is None else (op, x.dtype, x.size, arg)


P2P = tuple[str, Array, int, int]
"""One entry of a `batch_p2p`: ("isend" | "irecv", array, group rank of the peer, tag)."""


class Completion(Protocol):
    """Handle of an op launched by `Backend.start`: the surface of `axond.distributed.work.Work`."""

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the op (False if still running after `timeout` s); raise its failure."""

    def result(self) -> Any:
        """Wait, then return what the op's method returns."""

    def is_completed(self) -> bool:
        """Whether the op finished (or failed); never blocks."""

    def is_success(self) -> bool:
        """Whether the op finished without error."""

    def exception(self) -> BaseException | None:
        """The failure of a finished op, or None."""


class BackendSettings(Protocol):
    """What a backend's own options class provides (tcp: `TcpOptions`): a frozen dataclass it declares as its
    `Backend.options_class`, read from the group's `RuntimeEnv` unless given in `BackendOptions`."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Any:
        """The options the variables of `environ` (`RuntimeEnv.environ`) set (the defaults where they set none)."""

    def for_new_group(self) -> Any:
        """These options for a group made by `new_group` (settings only the default group has, like a fixed port,
        reset)."""


@dataclass(frozen=True, init=False)
class BackendOptions:
    """Settings of a process group's backend: the ones every backend shares, and each backend's own by its name."""

    timeout: float = 300.0
    """Seconds any blocking call may take before it raises `DistributedError`."""
    job_secret: bytes = b""
    """Shared secret of the job generation; peers prove they know it before any data flows."""
    host: str | None = None
    """Address to listen on and advertise (None: from AXOND_SOCKET_IFNAME, else the route to the coordinator)."""
    device: int | None = None
    """GPU index for device backends (None: LOCAL_RANK)."""
    env: RuntimeEnv | None = None
    """The process's environment as `init_process_group` read it (`axond.config`); None: read when a group is created
    with these options (`create_group` fills it in, see `resolved`)."""
    per_backend: Mapping[str, BackendSettings] = field(default_factory=dict)
    """Backend name -> that backend's own options, an instance of its `options_class` (`BackendOptions(tcp=TcpOptions(
    ...))`); a backend not named reads its own from `env` when the group is created. Checked by
    `registry.check_options`."""

    def __init__(self, timeout: float = 300.0, job_secret: bytes = b"", host: str | None = None,
                 device: int | None = None, per_backend: Mapping[str, BackendSettings] | None = None,
                 env: RuntimeEnv | None = None, **by_name: BackendSettings | None) -> None:
        """`by_name` adds per-backend options by backend name (`tcp=TcpOptions(...)`); None entries are left out."""
        merged = dict(per_backend or {})
        merged.update({name: value for name, value in by_name.items() if value is not None})
        for name, value in (("timeout", float(timeout)), ("job_secret", job_secret), ("host", host),
                            ("device", device), ("env", env),
                            ("per_backend", merged)):
            object.__setattr__(self, name, value)

    def runtime_env(self) -> RuntimeEnv:
        """`env`, else this process's environment read now."""
        return self.env if self.env is not None else RuntimeEnv.from_env()

    def resolved(self) -> BackendOptions:
        """These options with `env` filled in (read now if not given): what a group keeps, and its subgroups inherit."""
        return self if self.env is not None else replace(self, env=RuntimeEnv.from_env())

    def options_of(self, backend: str) -> BackendSettings | None:
        """The options given for backend `backend`, or None (it reads its own from the environment)."""
        return self.per_backend.get(backend)

    def for_new_group(self, timeout: float | None = None) -> BackendOptions:
        """These options for a group made by `new_group`: each backend's through its `for_new_group`, and `timeout`
        if given."""
        return replace(self, timeout=self.timeout if timeout is None else float(timeout),
                       per_backend={name: value.for_new_group() for name, value in self.per_backend.items()})


class Backend(ABC):
    """Communicator of one process group; built by `create_backend` from the registry."""

    name: ClassVar[str]
    options_class: ClassVar[type[BackendSettings] | None] = None
    """This backend's own options (given as `BackendOptions(<name>=...)`), or None: it takes none."""
    host_ranks: int = 1
    """Ranks of the group on this host, as far as the backend knows (tcp: from its sockets' peers)."""
    host_cores: int = 1 << 16
    """Cores this rank may use, as far as the backend knows (default: not limited): with `host_ranks`, whether a
    communication thread has a core to itself (the torch backend's `overlaps`)."""

    def __init__(self, store: Store, rank: int, size: int, group_name: str, options: BackendOptions) -> None:
        self.store = store
        """The group's namespace of the job's KV store (already prefixed by group)."""
        self.rank = rank
        self.size = size
        self.group_name = group_name
        self.options = options

    def own_options(self) -> Any:
        """This backend's own options: those given in `options`, else its `options_class` read from the group's
        environment (`options.env`; None for a backend without any)."""
        given = self.options.options_of(self.name)
        if given is not None or self.options_class is None:
            return given
        return self.options_class.from_env(self.options.runtime_env().environ)

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
        `output_split_sizes[j]` rows (None: asked from the peers). See `axond.distributed.backends.splits`.
        """

    @abstractmethod
    def send(self, x: Array, dst: int, tag: int) -> None:
        """Send `x` to group rank `dst`."""

    @abstractmethod
    def recv(self, x: Array, src: int, tag: int) -> None:
        """Receive into `x` from group rank `src` (same shape, dtype and tag as the send)."""

    def posts_from_any_thread(self) -> bool:
        """Whether `post_send` may run on any thread while an op runs on the communication thread (tcp: yes), so
        that a send never waits behind a receive (`ProcessGroup.post_send`)."""
        return False

    def recv_any(self, x: Array, tag: int) -> int:
        """Receive into `x` from whichever member sends with `tag` first; returns its group rank."""
        raise DistributedError(f"recv from any source: the {self.name} backend needs the source rank (pass src=)",
                               op="recv")

    def post_send(self, x: Array, dst: int, tag: int) -> PendingSend | None:
        """Hand `x` for `dst` to the transport and return: an isend (run on the group's communication thread).

        Returns a `PendingSend` that completes once the bytes left this process, or None once they did. The
        default is `send` (None: it returned after sending); a transport that queues its sends (tcp) overrides
        it, so that later ops (an irecv) run while the data is still leaving.
        """
        self.send(x, dst, tag)
        return None

    def batch_p2p(self, batch: list[P2P]) -> None:
        """Run every ("isend" | "irecv", array, peer, tag) of `batch` so that no order of them deadlocks.

        The default posts every send (`post_send`), then receives every irecv in the batch's order, then waits
        for the sends; nccl runs the whole batch in one NCCL group. `ProcessGroup` calls it only through `start`.
        """
        pending = [self.post_send(x, peer, tag) for kind, x, peer, tag in batch if kind == "isend"]
        for kind, x, peer, tag in batch:
            if kind == "irecv":
                self.recv(x, peer, tag)
        for sent in pending:
            if sent is not None:
                sent.wait(self.options.timeout, True)

    def start(self, op: str, *args: Any, **kwargs: Any) -> Completion | None:
        """Launch op `op` (a key of `op_methods`, with its method's arguments) without waiting, and return the
        handle that tracks its completion; or None: this backend tracks none, run the op's method elsewhere.

        The default returns None: `ProcessGroup` runs async ops on its communication thread, in issue order.
        nccl overrides it (a CUDA event per op on the group's stream). `ProcessGroup` calls it only while its
        communication thread has no op queued, so that ops still start in issue order.
        """
        return None

    def prepared(self, signature: Signature) -> Callable[..., Any] | None:
        """The prepared form of the blocking op of `signature` (`signature` above) that this backend ran the full
        way just now, on this thread, as a runner: it takes the op's method arguments and returns what the method
        returns, or `MISSED` having done nothing. None: none (the default; the op keeps the full way).

        `ProcessGroup` asks right after each full run through its `FastPath` and runs the runner for later blocking
        calls of that signature while no async op is queued; a runner must check what it does not take (a stale form,
        an array it cannot use) and return `MISSED`, never raise for it.
        """
        return None

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

    def interrupt(self, reason: str) -> None:
        """`abort`, called from another thread than the one running the group's ops: those blocked on a peer that
        never answers must end too. The default is `abort(reason)`; tcp also shuts its own links down."""
        self.abort(reason)

    def abort_failed(self, reason: str) -> None:
        """`abort` because this rank's process failed: `reason` ("rank R failed: ExcType: message") is the
        root cause, which peers quote as it is. The default is `abort(reason)`."""
        self.abort(reason)


def op_methods(backend: Backend) -> dict[str, Callable[..., Any]]:
    """Every op `ProcessGroup` runs, by name, as the bound method of `backend` that runs it (the names `start` takes).

    "isend" is `post_send` (on the communication thread) and "batch_p2p" runs a whole `batch_isend_irecv`;
    the other names are the methods'.
    """
    b = backend
    return {
        "all_reduce": b.all_reduce, "broadcast": b.broadcast, "reduce": b.reduce, "all_gather": b.all_gather,
        "reduce_scatter": b.reduce_scatter, "gather": b.gather, "scatter": b.scatter, "all_to_all": b.all_to_all,
        "send": b.send, "isend": b.post_send, "recv": b.recv, "batch_p2p": b.batch_p2p, "barrier": b.barrier,
    }
