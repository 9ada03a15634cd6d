"""The torch.distributed-style module functions over a per-process default group.

Ranks given here (src, dst, new_group's ranks) are GLOBAL ranks; they are translated to the
group's local ranks. Everything also takes `group=` so that code can pass groups explicitly.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from axond.distributed.backends.base import Array, BackendOptions
from axond.distributed.backends.registry import available_backends
from axond.distributed.process_group import ProcessGroup, create_group
from axond.distributed.reduce_op import ReduceOp
from axond.distributed.tensor_args import accepts_torch
from axond.distributed.work import Work
from axond.errors import DistributedError
from axond.store import Store

_lock = threading.Lock()
_default: ProcessGroup | None = None
_owned_store: Store | None = None
_closers: list[Callable[[], None]] = []
"""Connections opened for the default group's store, closed by destroy_process_group."""
_local_rank = 0


def _env_int(name: str, given: int | None) -> int:
    if given is not None:
        return int(given)
    raw = os.environ.get(name)
    if raw is None:
        raise DistributedError(f"init_process_group: {name} is not set; launch with `axond worker`/`axond run`, "
                               f"or pass {name.lower()}=...")
    try:
        return int(raw)
    except ValueError as e:
        raise DistributedError(f"init_process_group: {name}={raw!r} is not an integer") from e


def _env_store(timeout: float) -> Store:
    """The job's KV store: the coordinator's (AXOND_COORDINATOR), else a FileStore (AXOND_FILE_STORE)."""
    coordinator = os.environ.get("AXOND_COORDINATOR")
    if coordinator:
        from axond.control import client

        conn = client.connect(coordinator, token=os.environ.get("AXOND_TOKEN") or None,
                              tls_ca=os.environ.get("AXOND_TLS_CA") or None)
        try:
            generation = int(os.environ.get("AXOND_GENERATION", "1"))
        except ValueError as e:
            raise DistributedError(f"AXOND_GENERATION={os.environ['AXOND_GENERATION']!r} is not an integer") from e
        store = conn.store(os.environ.get("AXOND_JOB", "default"), generation)
        _closers.append(conn.close)
        return store
    path = os.environ.get("AXOND_FILE_STORE")
    if path:
        from axond.distributed.file_store import FileStore

        return FileStore(path)
    raise DistributedError("init_process_group: no store; set AXOND_COORDINATOR (what `axond worker` does), "
                           "AXOND_FILE_STORE=<shared dir> for single-host runs, or pass store=...")


def _secret() -> bytes:
    raw = os.environ.get("AXOND_JOB_SECRET", "")
    try:
        return bytes.fromhex(raw)
    except ValueError as e:
        raise DistributedError("AXOND_JOB_SECRET must be hex (as the worker sets it)") from e


def init_process_group(backend: str = "auto", timeout: float = 300.0, *, rank: int | None = None,
                       world_size: int | None = None, store: Store | None = None, local_rank: int | None = None,
                       job_secret: bytes | None = None, host: str | None = None, port: int = 0) -> ProcessGroup:
    """Join the job's default group: everything from the environment unless given here.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, AXOND_COORDINATOR, AXOND_JOB, AXOND_GENERATION,
    AXOND_JOB_SECRET (hex), AXOND_TOKEN and AXOND_TLS_CA; keyword arguments override them.
    """
    global _default, _local_rank, _owned_store
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    with _lock:
        if _default is not None:
            raise DistributedError("init_process_group was already called in this process; "
                                   "call destroy_process_group() first")
        r = _env_int("RANK", rank)
        n = _env_int("WORLD_SIZE", world_size)
        if not 0 <= r < n:
            raise DistributedError(f"init_process_group: RANK={r} is outside WORLD_SIZE={n}")
        options = BackendOptions(timeout=float(timeout), job_secret=job_secret if job_secret is not None else _secret(),
                                 host=host, port=port, device=local_rank)
        owned = _env_store(timeout) if store is None else None
        try:
            _default = create_group(store if store is not None else owned, r, n, backend, options)  # type: ignore[arg-type]
        except BaseException:
            _close_owned(owned)
            raise
        _owned_store = owned
        _local_rank = int(local_rank if local_rank is not None else os.environ.get("LOCAL_RANK", "0"))
        return _default


def is_initialized() -> bool:
    """Whether this process joined a default group."""
    return _default is not None


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Close `group` (default: the default group, which becomes uninitialised)."""
    global _default, _owned_store
    if group is not None and group is not _default:
        group.destroy()
        return
    with _lock:
        pg, _default = _default, None
        owned, _owned_store = _owned_store, None
    if pg is not None:
        pg.destroy()
    _close_owned(owned)


def _close_owned(store: Store | None) -> None:
    if store is not None:
        store.close()
    while _closers:
        _closers.pop()()


def default_group() -> ProcessGroup:
    """The group set up by `init_process_group`, or a clear error."""
    if _default is None:
        raise DistributedError("the default process group is not initialised; call axond.init_process_group() first")
    return _default


def _group(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else default_group()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group` (default: global rank)."""
    return _group(group).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of members of `group` (default: the world)."""
    return _group(group).size


def get_local_rank() -> int:
    """Rank of this process on its node (LOCAL_RANK)."""
    default_group()
    return _local_rank


def get_backend(group: ProcessGroup | None = None) -> str:
    """The backend of `group` (default: the default group): "tcp" or "nccl"."""
    return _group(group).backend_name


def get_process_group_ranks(group: ProcessGroup) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order."""
    return list(group.ranks)


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """The global rank of member `group_rank` of `group`."""
    if not 0 <= group_rank < len(group.ranks):
        raise ValueError(f"group rank {group_rank} is outside group '{group.name}' of size {len(group.ranks)}")
    return group.global_rank_of(group_rank)


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    """The rank in `group` of global rank `global_rank` (ValueError if it is not a member)."""
    return group.group_rank(global_rank)


def is_available() -> bool:
    """Whether collectives can run here (always: the tcp backend needs nothing but sockets)."""
    return True


def is_nccl_available() -> bool:
    """Whether the nccl backend can run here: CuPy with NCCL and a CUDA device (see `BackendUnavailable`)."""
    return "nccl" in available_backends()


@accepts_torch
def all_reduce(x: Array, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Reduce `x` in place over the group."""
    return _group(group).all_reduce(x, op, async_op=async_op)


@accepts_torch
def broadcast(x: Array, src: int = 0, group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Copy `x` of global rank `src` into `x` on every member."""
    g = _group(group)
    return g.broadcast(x, g.group_rank(src), async_op=async_op)


@accepts_torch
def reduce(x: Array, dst: int = 0, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
           async_op: bool = False) -> Work | None:
    """Reduce `x` into `x` on global rank `dst`."""
    g = _group(group)
    return g.reduce(x, g.group_rank(dst), op, async_op=async_op)


@accepts_torch
def all_gather(x: Array, group: ProcessGroup | None = None, async_op: bool = False, out: Array | None = None) -> Any:
    """Return an array of shape (group size, *x.shape) (`out=` to fill a preallocated one)."""
    return _group(group).all_gather(x, async_op=async_op, out=out)


@accepts_torch
def reduce_scatter(x: Array, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                   async_op: bool = False, out: Array | None = None) -> Any:
    """Reduce `x` and return this rank's block of x.shape[0] // size rows (`out=` to fill a preallocated one)."""
    return _group(group).reduce_scatter(x, op, async_op=async_op, out=out)


@accepts_torch
def gather(x: Array, dst: int = 0, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Return (size, *x.shape) on global rank `dst`, None elsewhere."""
    g = _group(group)
    return g.gather(x, g.group_rank(dst), async_op=async_op)


@accepts_torch
def scatter(x: Array | None, src: int = 0, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
    """Return this rank's slice of the (size, ...) array held by global rank `src`."""
    g = _group(group)
    return g.scatter(x, g.group_rank(src), async_op=async_op)


@accepts_torch
def all_to_all(x: Array, group: ProcessGroup | None = None, async_op: bool = False,
               input_split_sizes: Sequence[int] | None = None, output_split_sizes: Sequence[int] | None = None) -> Any:
    """Row block i of `x` goes to member i; return the received blocks in rank order (uneven blocks:
    `input_split_sizes` / `output_split_sizes` rows, see `ProcessGroup.all_to_all`)."""
    return _group(group).all_to_all(x, async_op=async_op, input_split_sizes=input_split_sizes,
                                    output_split_sizes=output_split_sizes)


@accepts_torch
def send(x: Array, dst: int, tag: int = 0, group: ProcessGroup | None = None) -> None:
    """Send `x` to global rank `dst`."""
    g = _group(group)
    g.send(x, g.group_rank(dst), tag)


@accepts_torch
def recv(x: Array, src: int, tag: int = 0, group: ProcessGroup | None = None) -> None:
    """Receive into `x` from global rank `src`."""
    g = _group(group)
    g.recv(x, g.group_rank(src), tag)


@accepts_torch
def isend(x: Array, dst: int, tag: int = 0, group: ProcessGroup | None = None) -> Work:
    """Asynchronous `send`; the Work completes once the data left this process."""
    g = _group(group)
    return g.isend(x, g.group_rank(dst), tag)


@accepts_torch
def irecv(x: Array, src: int, tag: int = 0, group: ProcessGroup | None = None) -> Work:
    """Asynchronous `recv` into `x`."""
    g = _group(group)
    return g.irecv(x, g.group_rank(src), tag)


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Return once every member entered the barrier."""
    return _group(group).barrier(async_op=async_op)


def monitored_barrier(group: ProcessGroup | None = None, timeout: float | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier through the job's store that names the ranks that did not arrive (see `ProcessGroup.monitored_barrier`)."""
    _group(group).monitored_barrier(timeout, wait_all_ranks)


def new_group(ranks: Sequence[int], backend: str | None = None, group: ProcessGroup | None = None,
              timeout: float | None = None) -> ProcessGroup:
    """Subgroup of global `ranks`; every rank of the parent calls it in the same order (non-members too).

    `timeout` (seconds) bounds its calls instead of the parent's timeout.
    """
    return _group(group).new_group(ranks, backend, timeout)
