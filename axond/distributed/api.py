"""The torch.distributed-style module functions over a per-process default group.

Ranks given here (src, dst, new_group's ranks) are GLOBAL ranks; they are translated to the
group's local ranks. Everything also takes `group=` so that code can pass groups explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, overload

from axond.distributed.forms import torch_forms as tf
from axond.distributed.backends.base import Array
from axond.distributed import default_registry as defaults
from axond.distributed.backends.registry import available_backends
from axond.distributed.lifecycle import (  # noqa: F401 -- re-exported: the module functions' one home
    BACKEND_ALIASES, DEFAULT_TIMEOUT, destroy_process_group, get_local_rank, init_process_group, is_initialized,
    read_env,
)
from axond.distributed.process_group import ProcessGroup
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.forms.tensor_args import accepts_torch
from axond.distributed.work import Work

_TORCH: dict[str, Any] = {"group": None, "async_op": False}
_TORCH_OP: dict[str, Any] = {**_TORCH, "op": ReduceOp.SUM}
_GATHER_KWARGS = frozenset(("group", "async_op", "out"))
_SCATTER_KWARGS = frozenset(("op", *_GATHER_KWARGS))
"""The keywords of axond's own forms of all_gather and reduce_scatter: a call with only these (and no list where
torch's forms have one) is bound as Python would bind it, without `torch_forms.bind` (small ops are mostly overhead)."""


def default_group() -> ProcessGroup:
    """The group set up by `init_process_group`, or a clear error (`default_registry.require`)."""
    return defaults.require()


def _group(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else defaults.require()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group` (default: global rank)."""
    return _group(group).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of members of `group` (default: the world)."""
    return _group(group).size


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
    return (default_group() if group is None else group).all_reduce(x, op, async_op)


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


@overload
def all_gather(x: Array, group: ProcessGroup | None = None, async_op: bool = False, out: Array | None = None) -> Any: ...
@overload
def all_gather(tensor_list: list[Array], tensor: Array, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None: ...
@accepts_torch
def all_gather(*args: Any, **kwargs: Any) -> Any:
    """Return an array of shape (group size, *x.shape) (`out=` to fill a preallocated one).

    torch's form `all_gather(tensor_list, tensor)` (a list first) fills `tensor_list[i]` with member i's
    `tensor` and returns None (a Work if `async_op`).
    """
    if len(args) == 1 and not isinstance(args[0], (list, tuple)) and kwargs.keys() <= _GATHER_KWARGS:  # as bound
        return _group(kwargs.get("group")).all_gather(args[0], async_op=kwargs.get("async_op", False),
                                                      out=kwargs.get("out"))
    if (args and tf.is_list(args[0])) or "tensor_list" in kwargs:
        a = tf.bind("all_gather", ("tensor_list", "tensor", "group", "async_op"), args, kwargs, _TORCH)
        return tf.all_gather_into_list(_group(a["group"]), a["tensor_list"], a["tensor"], a["async_op"])
    a = tf.bind("all_gather", ("x", "group", "async_op", "out"), args, kwargs, {**_TORCH, "out": None})
    return _group(a["group"]).all_gather(a["x"], async_op=a["async_op"], out=a["out"])


@overload
def reduce_scatter(x: Array, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                   async_op: bool = False, out: Array | None = None) -> Any: ...
@overload
def reduce_scatter(output: Array, input_list: list[Array], op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup | None = None, async_op: bool = False) -> Work | None: ...
@accepts_torch
def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
    """Reduce `x` and return this rank's block of x.shape[0] // size rows (`out=` to fill a preallocated one).

    torch's form `reduce_scatter(output, input_list, op)` (a list second) writes the reduction of every
    member's `input_list[rank]` into `output` and returns None (a Work if `async_op`).
    """
    if len(args) == 1 and not isinstance(args[0], (list, tuple)) and kwargs.keys() <= _SCATTER_KWARGS:  # as bound
        return _group(kwargs.get("group")).reduce_scatter(args[0], kwargs.get("op", ReduceOp.SUM),
                                                          async_op=kwargs.get("async_op", False), out=kwargs.get("out"))
    if len(args) == 2 and not isinstance(args[1], (list, tuple)) and kwargs.keys() <= _GATHER_KWARGS:  # (x, op)
        return _group(kwargs.get("group")).reduce_scatter(args[0], args[1], async_op=kwargs.get("async_op", False),
                                                          out=kwargs.get("out"))
    if (len(args) > 1 and tf.is_list(args[1])) or "input_list" in kwargs:
        a = tf.bind("reduce_scatter", ("output", "input_list", "op", "group", "async_op"), args, kwargs, _TORCH_OP)
        return tf.reduce_scatter_from_list(_group(a["group"]), a["output"], a["input_list"], a["op"], a["async_op"])
    a = tf.bind("reduce_scatter", ("x", "op", "group", "async_op", "out"), args, kwargs, {**_TORCH_OP, "out": None})
    return _group(a["group"]).reduce_scatter(a["x"], a["op"], async_op=a["async_op"], out=a["out"])


@overload
def gather(x: Array, dst: int = 0, group: ProcessGroup | None = None, async_op: bool = False) -> Any: ...
@overload
def gather(tensor: Array, gather_list: list[Array] | None, dst: int = 0, group: ProcessGroup | None = None,
           async_op: bool = False) -> Work | None: ...
@accepts_torch
def gather(*args: Any, **kwargs: Any) -> Any:
    """Return (size, *x.shape) on global rank `dst`, None elsewhere.

    torch's form `gather(tensor, gather_list, dst)` (a list or None second) fills `gather_list` on `dst`.
    """
    if (len(args) > 1 and (args[1] is None or tf.is_list(args[1]))) or "gather_list" in kwargs or "tensor" in kwargs:
        a = tf.bind("gather", ("tensor", "gather_list", "dst", "group", "async_op"), args, kwargs,
                    {**_TORCH, "gather_list": None, "dst": 0})
        g = _group(a["group"])
        return tf.gather_into_list(g, a["tensor"], a["gather_list"], g.group_rank(a["dst"]), a["async_op"])
    a = tf.bind("gather", ("x", "dst", "group", "async_op"), args, kwargs, {**_TORCH, "dst": 0})
    g = _group(a["group"])
    return g.gather(a["x"], g.group_rank(a["dst"]), async_op=a["async_op"])


@overload
def scatter(x: Array | None, src: int = 0, group: ProcessGroup | None = None, async_op: bool = False) -> Any: ...
@overload
def scatter(tensor: Array, scatter_list: list[Array] | None, src: int = 0, group: ProcessGroup | None = None,
            async_op: bool = False) -> Work | None: ...
@accepts_torch
def scatter(*args: Any, **kwargs: Any) -> Any:
    """Return this rank's slice of the (size, ...) array held by global rank `src`.

    torch's form `scatter(tensor, scatter_list, src)` (a list or None second) fills `tensor` with
    `scatter_list[rank]` of `src`. In axond's form an array given on another rank that has the slice's
    shape and dtype (torch's `scatter(tensor, src=0)` there) receives it too.
    """
    if (len(args) > 1 and (args[1] is None or tf.is_list(args[1]))) or "scatter_list" in kwargs or "tensor" in kwargs:
        a = tf.bind("scatter", ("tensor", "scatter_list", "src", "group", "async_op"), args, kwargs,
                    {**_TORCH, "scatter_list": None, "src": 0})
        g = _group(a["group"])
        return tf.scatter_from_list(g, a["tensor"], a["scatter_list"], g.group_rank(a["src"]), a["async_op"])
    a = tf.bind("scatter", ("x", "src", "group", "async_op"), args, kwargs, {**_TORCH, "src": 0})
    g, x = _group(a["group"]), a["x"]
    src = g.group_rank(a["src"])

    def fill(got: Array) -> None:  # torch's scatter(tensor, src=0) on a non-source rank
        if x is not None and g.rank != src and tuple(getattr(x, "shape", ())) == tuple(got.shape) \
                and x.dtype == got.dtype:
            x[...] = got
    got = g.scatter(x, src, async_op=a["async_op"])
    if a["async_op"]:
        return tf.ThenWork(got, fill)
    fill(got)
    return got


@accepts_torch
def all_to_all(*args: Any, **kwargs: Any) -> Any:
    """Row block i of `x` goes to member i; return the received blocks in rank order (uneven blocks:
    `input_split_sizes` / `output_split_sizes` rows, see `ProcessGroup.all_to_all`).

    torch's form `all_to_all(output_tensor_list, input_tensor_list)` (a list first) sends
    `input_tensor_list[i]` to member i and fills `output_tensor_list[j]` with member j's.
    """
    if (args and tf.is_list(args[0])) or "output_tensor_list" in kwargs:
        a = tf.bind("all_to_all", ("output_tensor_list", "input_tensor_list", "group", "async_op"), args, kwargs, _TORCH)
        return tf.all_to_all_lists(_group(a["group"]), a["output_tensor_list"], a["input_tensor_list"], a["async_op"])
    a = tf.bind("all_to_all", ("x", "group", "async_op", "input_split_sizes", "output_split_sizes"), args, kwargs,
                {**_TORCH, "input_split_sizes": None, "output_split_sizes": None})
    return _group(a["group"]).all_to_all(a["x"], async_op=a["async_op"], input_split_sizes=a["input_split_sizes"],
                                         output_split_sizes=a["output_split_sizes"])


@accepts_torch
def all_to_all_single(output: Array, input: Array, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group: ProcessGroup | None = None,
                      async_op: bool = False) -> Work | None:
    """torch's `all_to_all_single`: `input`'s row blocks go to the members; `output` receives theirs in rank order."""
    return tf.all_to_all_single(_group(group), output, input, output_split_sizes, input_split_sizes, async_op)


@accepts_torch
def all_gather_into_tensor(output_tensor: Array, input_tensor: Array, group: ProcessGroup | None = None,
                           async_op: bool = False) -> Work | None:
    """torch's `all_gather_into_tensor`: `output_tensor` ((size * n, ...) or (size, ...)) receives every member's input."""
    return tf.all_gather_into_tensor(_group(group), output_tensor, input_tensor, async_op)


@accepts_torch
def reduce_scatter_tensor(output: Array, input: Array, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                          async_op: bool = False) -> Work | None:
    """torch's `reduce_scatter_tensor`: `output` receives this member's block of the reduction of `input`."""
    return tf.reduce_scatter_tensor(_group(group), output, input, op, async_op)


@accepts_torch
def send(x: Array, dst: int, tag: Any = 0, group: Any = None) -> None:
    """Send `x` to global rank `dst` (torch's order `send(x, dst, group, tag)` works too)."""
    g, t = tf.p2p_group_and_tag(tag, group)
    pg = _group(g)
    pg.send(x, pg.group_rank(dst), t)


@accepts_torch
def recv(x: Array, src: int | None = None, tag: Any = 0, group: Any = None) -> int:
    """Receive into `x` from global rank `src`; returns `src` (torch returns the sender's rank)."""
    g, t = tf.p2p_group_and_tag(tag, group)
    pg = _group(g)
    pg.recv(x, pg.group_rank(_peer(src, "recv")), t)
    return int(src)  # type: ignore[arg-type]


@accepts_torch
def isend(x: Array, dst: int, tag: Any = 0, group: Any = None) -> Work:
    """Asynchronous `send`; the Work completes once the data left this process."""
    g, t = tf.p2p_group_and_tag(tag, group)
    pg = _group(g)
    return pg.isend(x, pg.group_rank(dst), t)


@accepts_torch
def irecv(x: Array, src: int | None = None, tag: Any = 0, group: Any = None) -> Work:
    """Asynchronous `recv` into `x`."""
    g, t = tf.p2p_group_and_tag(tag, group)
    pg = _group(g)
    return pg.irecv(x, pg.group_rank(_peer(src, "irecv")), t)


def _peer(src: int | None, op: str) -> int:
    if src is None:
        raise ValueError(f"{op} needs src=<global rank>: receiving from any rank (torch's src=None) is not supported")
    return src


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Return once every member entered the barrier."""
    return _group(group).barrier(async_op=async_op)


def monitored_barrier(group: ProcessGroup | None = None, timeout: float | timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier through the job's store that names the ranks that did not arrive (see `ProcessGroup.monitored_barrier`)."""
    _group(group).monitored_barrier(timeout, wait_all_ranks)


def new_group(ranks: Sequence[int] | None = None, backend: Any = None, group: ProcessGroup | None = None,
              timeout: float | timedelta | None = None) -> ProcessGroup:
    """Subgroup of global `ranks` (None: all of `group`'s); every rank of the parent calls it in the same order
    (non-members too).

    `timeout` (seconds or a timedelta) bounds its calls instead of the parent's timeout. torch's positional
    order `new_group(ranks, timeout, backend)` works too: a timeout second is taken as the timeout.
    """
    if backend is not None and not isinstance(backend, str):  # torch's new_group(ranks, timeout, backend)
        if timeout is not None:
            raise TypeError(f"new_group: timeout given twice ({backend!r} and {timeout!r})")
        timeout, backend = backend, None
        if isinstance(group, str):
            backend, group = group, None
    g = _group(group)
    name = BACKEND_ALIASES.get(backend.lower(), backend.lower()) if isinstance(backend, str) else None
    return g.new_group(g.ranks if ranks is None else ranks, name, timeout)
