"""torch.distributed's call forms of the collectives, beside axond's own (see docs/torch-compat.md).

A Python list or tuple where torch puts one selects the torch form: `all_gather(tensor_list, tensor)`,
`reduce_scatter(output, input_list)`, `gather(tensor, gather_list, dst)`, `scatter(tensor, scatter_list,
src)` and `all_to_all(output_list, input_list)`; arrays select axond's. Each torch form runs the same
collective on the wire as axond's form (so ranks may mix them) and then writes the result where torch
does. Ranks given here (`dst`, `src`) are GROUP ranks; `axond.distributed.api` translates global ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from axond.distributed.backends.base import Array
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.forms.scalars import refuse_scalar
from axond.distributed.process_group import ProcessGroup
from axond.distributed.work import Work



def is_list(value: Any) -> bool:
    """Whether `value` is a torch-style list of tensors (a Python list or tuple)."""
    return isinstance(value, (list, tuple))


def bind(op: str, names: Sequence[str], args: Sequence[Any], kwargs: Mapping[str, Any],
         defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Bind a call's arguments to `names` as Python would, for functions that accept two signatures."""
    if len(args) > len(names):
        raise TypeError(f"{op}() takes at most {len(names)} positional arguments ({len(args)} given): "
                        f"({', '.join(names)})")
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names:
            raise TypeError(f"{op}() got an unexpected keyword argument {key!r}; its arguments are ({', '.join(names)})")
        if key in bound:
            raise TypeError(f"{op}() got multiple values for argument {key!r}")
        bound[key] = value
    missing = [n for n in names if n not in bound and n not in defaults]
    if missing:
        raise TypeError(f"{op}() is missing {', '.join(map(repr, missing))}; its arguments are ({', '.join(names)})")
    return {**defaults, **bound}


def p2p_group_and_tag(tag: Any, group: Any) -> tuple[Any, int]:
    """(group, tag) of send/recv called either as axond's `(x, peer, tag, group)` or torch's `(x, peer, group, tag)`."""
    if isinstance(tag, ProcessGroup) or (tag is None and group is not None and not isinstance(group, ProcessGroup)):
        tag, group = group, tag
    return group, 0 if tag is None else int(tag)


class ThenWork(Work):
    """The Work of a torch-form call: the collective's Work, then the copy to where torch puts the result."""

    def __init__(self, inner: Any, then: Callable[[Any], None]) -> None:
        super().__init__(inner.op if hasattr(inner, "op") else "collective", getattr(inner, "group", ""), 0.0)
        self._inner = inner
        self._then = then
        self._then_lock = threading.Lock()
        self._copied = False

    def _copy(self) -> None:
        with self._then_lock:
            if not self._copied:
                self._then(self._inner.result())
                self._copied = True

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        if not self._inner.wait(timeout.total_seconds() if isinstance(timeout, timedelta) else timeout):
            return False
        self._copy()
        return True

    def is_completed(self) -> bool:
        if not self._inner.is_completed():
            return False
        if self._inner.exception() is None:
            self._copy()
        return True

    def is_success(self) -> bool:
        return self.is_completed() and self._inner.exception() is None

    def exception(self) -> BaseException | None:
        exc: BaseException | None = self._inner.exception()
        return exc

    def result(self) -> Any:
        self.wait()
        return self._inner.result()


def _finish(result: Any, async_op: bool, then: Callable[[Any], None]) -> Work | None:
    """Sync: copy now and return None (torch's return). Async: a Work that copies once the op finished."""
    if async_op:
        return ThenWork(result, then)
    then(result)
    return None


def _xp(x: Array) -> Any:
    """The array module of `x` (NumPy, or CuPy for device arrays)."""
    if isinstance(x, np.ndarray):
        return np
    import importlib

    return importlib.import_module(type(x).__module__.split(".")[0])


def _check_like(op: str, what: str, arrays: Sequence[Any], like: Array, count: int | None) -> None:
    if count is not None and len(arrays) != count:
        raise ValueError(f"{op}: {what} has {len(arrays)} arrays; it needs one per group member ({count})")
    for i, a in enumerate(arrays):
        refuse_scalar(a, op)
        if a.shape != like.shape or a.dtype != like.dtype:
            raise ValueError(f"{op}: {what}[{i}] is {a.dtype} {tuple(a.shape)}; every entry must be "
                             f"{like.dtype} {tuple(like.shape)} like the input")


def _contiguous_view(x: Array, shape: tuple[int, ...]) -> Array | None:
    """`x` reshaped to `shape` without a copy, or None if `x` is not C-contiguous."""
    return x.reshape(shape) if x.flags.c_contiguous else None


def all_gather_into_list(g: ProcessGroup, outputs: Sequence[Array], x: Array, async_op: bool) -> Work | None:
    """torch's `all_gather(tensor_list, tensor)`: entry i of `outputs` receives member i's `x`."""
    refuse_scalar(x, "all_gather")
    _check_like("all_gather", "tensor_list", outputs, x, g.size)

    def then(full: Array) -> None:
        for i, o in enumerate(outputs):
            o[...] = full[i]
    return _finish(g.all_gather(x, async_op=async_op), async_op, then)


def all_gather_into_tensor(g: ProcessGroup, output: Array, x: Array, async_op: bool) -> Work | None:
    """torch's `all_gather_into_tensor`: `output` is (size * n, ...) or (size, *x.shape), filled in rank order."""
    refuse_scalar(x, "all_gather_into_tensor")
    if output.size != g.size * x.size or output.dtype != x.dtype:
        raise ValueError(f"all_gather_into_tensor: output is {output.dtype} {tuple(output.shape)}; it needs "
                         f"{g.size} x {x.size} {x.dtype} elements ({g.size} members' inputs of {tuple(x.shape)})")
    view = _contiguous_view(output, (g.size, *x.shape))
    if view is not None:
        return _finish(g.all_gather(x, async_op=async_op, out=view), async_op, lambda _: None)

    def then(full: Array) -> None:
        output[...] = full.reshape(output.shape)
    return _finish(g.all_gather(x, async_op=async_op), async_op, then)


def _reduce_scatter_flat(g: ProcessGroup, output: Array, rows: Array, op: ReduceOp, async_op: bool) -> Work | None:
    """Reduce-scatter `rows` (size, n) into `output` (n elements): one row per member."""
    view = _contiguous_view(output, (1, output.size))
    if view is not None:
        return _finish(g.reduce_scatter(rows, op, async_op=async_op, out=view), async_op, lambda _: None)

    def then(block: Array) -> None:
        output[...] = block.reshape(output.shape)
    return _finish(g.reduce_scatter(rows, op, async_op=async_op), async_op, then)


def reduce_scatter_from_list(g: ProcessGroup, output: Array, inputs: Sequence[Array], op: ReduceOp,
                             async_op: bool) -> Work | None:
    """torch's `reduce_scatter(output, input_list, op)`: `output` receives the reduction of every member's
    `input_list[rank]`."""
    refuse_scalar(output, "reduce_scatter")
    _check_like("reduce_scatter", "input_list", inputs, output, g.size)
    rows = _xp(output).stack(list(inputs)).reshape(g.size, -1)
    return _reduce_scatter_flat(g, output, rows, op, async_op)


def reduce_scatter_tensor(g: ProcessGroup, output: Array, x: Array, op: ReduceOp, async_op: bool) -> Work | None:
    """torch's `reduce_scatter_tensor`: `x` is (size * n, ...) or (size, *output.shape); `output` gets this
    member's block of the reduction."""
    refuse_scalar(output, "reduce_scatter_tensor")
    if x.size != g.size * output.size or x.dtype != output.dtype:
        raise ValueError(f"reduce_scatter_tensor: input is {x.dtype} {tuple(x.shape)}; it needs {g.size} x "
                         f"{output.size} {output.dtype} elements (one output of {tuple(output.shape)} per member)")
    rows = x.reshape(g.size, -1) if x.flags.c_contiguous else _xp(x).ascontiguousarray(x).reshape(g.size, -1)
    return _reduce_scatter_flat(g, output, rows, op, async_op)


def gather_into_list(g: ProcessGroup, x: Array, gather_list: Sequence[Array] | None, dst: int,
                     async_op: bool) -> Work | None:
    """torch's `gather(tensor, gather_list, dst)`: on `dst`, entry i of `gather_list` receives member i's `x`."""
    refuse_scalar(x, "gather")
    if g.rank == dst:
        if gather_list is None:
            raise ValueError(f"gather: the destination rank needs gather_list, a list of {g.size} arrays like the input")
        _check_like("gather", "gather_list", gather_list, x, g.size)
    elif gather_list:
        raise ValueError("gather: gather_list must not be given on ranks other than dst (pass None there), as in torch")
    targets = list(gather_list or [])

    def then(full: Array | None) -> None:
        if full is not None:
            for i, o in enumerate(targets):
                o[...] = full[i]
    return _finish(g.gather(x, dst, async_op=async_op), async_op, then)


def scatter_from_list(g: ProcessGroup, output: Array, scatter_list: Sequence[Array] | None, src: int,
                      async_op: bool) -> Work | None:
    """torch's `scatter(tensor, scatter_list, src)`: member i's `tensor` receives `scatter_list[i]` of `src`."""
    refuse_scalar(output, "scatter")
    full = None
    if g.rank == src:
        if scatter_list is None:
            raise ValueError(f"scatter: the source rank needs scatter_list, a list of {g.size} arrays like the output")
        _check_like("scatter", "scatter_list", scatter_list, output, g.size)
        full = _xp(output).stack(list(scatter_list))
    elif scatter_list:
        raise ValueError("scatter: scatter_list must not be given on ranks other than src (pass None there), as in torch")
    return _finish(g.scatter(full, src, async_op=async_op), async_op, lambda got: fill(output, got, "scatter"))


def fill(output: Array, got: Array, op: str) -> None:
    """Copy a received `got` into the caller's `output`, or ValueError if the shapes or dtypes differ."""
    if tuple(got.shape) != tuple(output.shape) or got.dtype != output.dtype:
        raise ValueError(f"{op}: received {got.dtype} {tuple(got.shape)}, but the output array is "
                         f"{output.dtype} {tuple(output.shape)}")
    output[...] = got


def all_to_all_single(g: ProcessGroup, output: Array, x: Array, output_split_sizes: Sequence[int] | None,
                      input_split_sizes: Sequence[int] | None, async_op: bool) -> Work | None:
    """torch's `all_to_all_single`: `x`'s row blocks go to the members; `output` receives theirs in rank order."""
    refuse_scalar(output, "all_to_all_single")
    refuse_scalar(x, "all_to_all_single")
    got = g.all_to_all(x, async_op=async_op, input_split_sizes=input_split_sizes,
                       output_split_sizes=output_split_sizes)
    return _finish(got, async_op, lambda out: fill(output, out, "all_to_all_single"))


def all_to_all_lists(g: ProcessGroup, outputs: Sequence[Array], inputs: Sequence[Array],
                     async_op: bool) -> Work | None:
    """torch's `all_to_all(output_tensor_list, input_tensor_list)`: `inputs[i]` goes to member i, `outputs[j]`
    receives member j's. One flat all_to_all with split sizes carries them all."""
    if len(inputs) != g.size or len(outputs) != g.size:
        raise ValueError(f"all_to_all: needs {g.size} input and {g.size} output arrays, got {len(inputs)} and "
                         f"{len(outputs)}")
    for a in (*inputs, *outputs):
        refuse_scalar(a, "all_to_all")
        if a.dtype != inputs[0].dtype:
            raise ValueError(f"all_to_all: every array must be {inputs[0].dtype}, got one of {a.dtype}")
    xp = _xp(inputs[0])
    flat = xp.concatenate([a.reshape(-1) for a in inputs])
    got = g.all_to_all(flat, async_op=async_op, input_split_sizes=[a.size for a in inputs],
                       output_split_sizes=[o.size for o in outputs])

    def then(out: Array) -> None:
        at = 0
        for o in outputs:
            o[...] = out[at : at + o.size].reshape(o.shape)
            at += o.size
    return _finish(got, async_op, then)
