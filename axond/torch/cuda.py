"""`CudaCollectives`: the torch collectives of one "axond" group on CUDA tensors, run by axond's NCCL backend, or by
its staging path (device -> pinned host -> tcp -> device, as gloo does) where the members do not each have a GPU of
their own.

The NCCL group is created on the first CUDA op (a rendezvous of every member over the same torch store,
under its own name `torch-cuda:<group>`), on the device of that op's tensors. Every op is a short
function over `_launch`: stage the tensors (contiguous views, see `axond.torch.cuda_tensors`), start
the NCCL op with torch's current stream as CuPy's current stream (so NCCL runs after the kernels that
produced the inputs), queue the copy-backs on a side stream after it, and return a `CudaWork`. Argument
checks and their messages are the CPU path's (`AxondProcessGroup`). Outputs the NCCL backend allocates
(gather, scatter, all_to_all) are ready on the side stream, like the rest; only scatter's shape header and
all_to_all's split-size exchange wait on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from axond.distributed.process_group import ProcessGroup, create_group
from axond.errors import BackendUnavailable, DistributedError
from axond.torch.cuda_tensors import CudaStaged, as_cupy, as_torch, cupy_module, premultiply, stage
from axond.torch.cuda_work import CudaWork, ready_after
from axond.torch.reduce_ops import reduction

if TYPE_CHECKING:
    from axond.torch.process_group import AxondProcessGroup

Start = Callable[[ProcessGroup], list[Any]]
"""Starts the op's axond NCCL ops (async) on the group; returns their `NcclWork`s."""
Finish = Callable[[list[Any]], Any]
"""Queues the copy-backs (on the side stream) given the `NcclWork`s; returns the op's output tensors."""


class CudaCollectives:
    """The CUDA half of an `AxondCudaProcessGroup`; `owner` holds the store, ranks, options and argument checks."""

    def __init__(self, owner: AxondProcessGroup) -> None:
        self._owner = owner
        self._group: ProcessGroup | None = None
        self._device: torch.device | None = None
        self._side: Any = None
        self._side_cupy: Any = None
        self._cupy_streams: dict[int, Any] = {}
        """CuPy views (ExternalStream) of the torch streams ops were called on, by stream pointer."""

    def group_on(self, device: torch.device) -> ProcessGroup:
        """The axond NCCL group, built on `device` by the first CUDA op (every member must call that op)."""
        if self._group is not None and device == self._device:
            return self._group  # every later op: no device-index look-ups
        index = device.index if device.index is not None else torch.cuda.current_device()
        where = torch.device("cuda", index)
        o = self._owner
        if self._group is None:
            name = f"torch-cuda:{o.group_name}" if o.group_name else "torch-cuda"
            try:
                # "auto": NCCL when every member has a GPU of its own, else the staging path (ranks sharing a GPU)
                self._group = create_group(o._store, o._rank, o._size, "auto", replace(o._options, device=index),
                                           name=name)
            except BackendUnavailable as e:
                raise DistributedError(f"CUDA tensors on group '{o.group_name}': {e}; pip install 'axond[gpu]', or "
                                       "move the tensors with .cpu()", op="nccl_init", group=o.group_name,
                                       rank=o._rank) from e
            self._device, self._side = where, torch.cuda.Stream(where)
            self._side_cupy = cupy_module().cuda.ExternalStream(self._side.cuda_stream, index)
        elif where != self._device:
            raise ValueError(f"group '{o.group_name}' communicates on {self._device}, got a tensor on {where}; "
                             "one group uses one GPU per rank (torch.cuda.set_device before the first op)")
        return self._group

    def _launch(self, op: str, device: torch.device, start: Start, finish: Finish,
                touched: Sequence[torch.Tensor]) -> CudaWork:
        """The template of every op (see the module doc); `touched` are the tensors the side stream uses."""
        group = self.group_on(device)
        assert self._device is not None  # set by group_on
        cp, index = cupy_module(), self._device.index
        pointer = torch.cuda.current_stream(self._device).cuda_stream
        caller = self._cupy_streams.get(pointer)
        if caller is None:
            if len(self._cupy_streams) > 64:
                self._cupy_streams.clear()
            caller = self._cupy_streams[pointer] = cp.cuda.ExternalStream(pointer, index)
        with cp.cuda.Device(index), caller:
            works = start(group)
            ready_after(works, self._side_cupy)
        side = self._side
        with torch.cuda.stream(side):
            value = finish(works)
            for t in touched:
                t.record_stream(side)  # the allocator must not reuse them before the side stream is done
            ready = torch.cuda.Event()
            ready.record(side)
        return CudaWork(op, group.name, self._device, works, ready, side, value)

    def _run(self, op: str, staged: Sequence[CudaStaged], start: Start, value: Any, write: bool = True) -> CudaWork:
        """`_launch` for ops that work in place on `staged` (written back when `write`) and return `value`."""
        def finish(_: list[Any]) -> Any:
            for s in staged if write else ():
                s.write_back()
            return value
        touched = [t for s in staged for t in (s.buf, s.target)]
        return self._launch(op, staged[0].target.device, start, finish, touched)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> CudaWork:
        op, factor = reduction(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "allreduce")
        staged = [stage(t, "allreduce tensor", reduce=True) for t in tensors]
        for s in staged:
            premultiply(s.buf, factor)
        return self._run("allreduce", staged, lambda g: [g.all_reduce(as_cupy(s.buf), op, async_op=True)
                                                         for s in staged], tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> CudaWork:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> CudaWork:
        root = opts.rootRank if opts is not None else 0
        staged = [stage(t, "broadcast tensor") for t in tensors]
        return self._run("broadcast", staged, lambda g: [g.broadcast(as_cupy(s.buf), root, async_op=True)
                                                         for s in staged], tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> CudaWork:
        op, factor = reduction(opts.reduceOp, "reduce")
        staged = [stage(t, "reduce tensor", reduce=True) for t in tensors]
        for s in staged:
            premultiply(s.buf, factor)
        root = opts.rootRank
        return self._run("reduce", staged, lambda g: [g.reduce(as_cupy(s.buf), root, op, async_op=True)
                                                      for s in staged], tensors, write=self._owner.rank() == root)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> CudaWork:
        size, pairs = self._owner.size(), []
        for outs, t in zip(outputs, inputs):
            self._owner._check_list("allgather", outs, t)
            x = stage(t, "allgather input").buf
            pairs.append((x, torch.empty((size, *x.shape), dtype=x.dtype, device=x.device), outs))

        def finish(_: list[Any]) -> Any:
            for _, gathered, outs in pairs:
                for i, out in enumerate(outs):
                    out.copy_(gathered[i].view(out.shape))
            return outputs
        return self._launch("allgather", inputs[0].device,
                            lambda g: [g.all_gather(as_cupy(x), async_op=True, out=as_cupy(gathered))
                                       for x, gathered, _ in pairs],
                            finish, [t for x, gathered, outs in pairs for t in (x, gathered, *outs)])

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> CudaWork:
        return self.allgather(outputs, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> CudaWork:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> CudaWork:
        o, size = self._owner, self._owner.size()
        pairs = []
        for out, t in zip(outputs, inputs):
            o._check_whole_and_part("all_gather_into_tensor", out, t, "output", "input")
            pairs.append((stage(t, "all_gather_into_tensor input").buf.reshape(-1),
                          stage(out, "all_gather_into_tensor output")))
        return self._run("allgather_into_tensor_coalesced", [s for _, s in pairs],
                         lambda g: [g.all_gather(as_cupy(x), async_op=True, out=as_cupy(s.buf.view(size, -1)))
                                    for x, s in pairs], outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> CudaWork:
        op, factor = reduction(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter")
        pairs = []
        for out, ins in zip(outputs, inputs):
            self._owner._check_list("reduce_scatter", ins, out)
            x = torch.stack([stage(t, "reduce_scatter input", reduce=True).buf.reshape(-1) for t in ins])
            pairs.append((premultiply(x, factor), stage(out, "reduce_scatter output", reduce=True)))
        return self._run("reduce_scatter", [s for _, s in pairs],
                         lambda g: [g.reduce_scatter(as_cupy(x), op, async_op=True, out=as_cupy(s.buf.view(1, -1)))
                                    for x, s in pairs], outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> CudaWork:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> CudaWork:
        op, factor = reduction(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter_tensor")
        o, size = self._owner, self._owner.size()
        pairs = []
        for out, t in zip(outputs, inputs):
            o._check_whole_and_part("reduce_scatter_tensor", t, out, "input", "output")
            x = stage(t, "reduce_scatter_tensor input", reduce=True).buf.reshape(size, -1)
            x = x if factor is None else premultiply(x.clone(), factor)  # the caller's input stays as it was
            pairs.append((x, stage(out, "reduce_scatter_tensor output", reduce=True)))
        return self._run("reduce_scatter_tensor_coalesced", [s for _, s in pairs],
                         lambda g: [g.reduce_scatter(as_cupy(x), op, async_op=True, out=as_cupy(s.buf.view(1, -1)))
                                    for x, s in pairs], outputs)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> CudaWork:
        o, size = self._owner, self._owner.size()
        o._same_dtype("all_to_all", *outputs, *inputs)
        if len(outputs) != size or len(inputs) != size:
            raise ValueError(f"all_to_all on group '{o.group_name}': needs {size} input and output "
                             f"tensors (one per rank), got {len(inputs)} and {len(outputs)}")
        x = torch.cat([stage(t, "all_to_all input").buf.reshape(-1) for t in inputs])
        ins, outs = [t.numel() for t in inputs], [t.numel() for t in outputs]
        starts = [0, *accumulate(outs)]

        def finish(works: list[Any]) -> Any:
            got = as_torch(works[0].result(), x.dtype)  # allocated by the NCCL backend: the host waits
            for i, t in enumerate(outputs):
                t.copy_(got[starts[i]:starts[i + 1]].view(t.shape))
            return outputs
        return self._launch("alltoall", inputs[0].device,
                            lambda g: [g.all_to_all(as_cupy(x), async_op=True, input_split_sizes=ins,
                                                    output_split_sizes=outs)], finish, [x, *outputs])

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> CudaWork:
        o, size = self._owner, self._owner.size()
        o._same_dtype("all_to_all_single", output, input)
        x = stage(input, "all_to_all_single input").buf
        ins = list(input_split_sizes) or None
        outs = list(output_split_sizes) or None
        if ins is None and outs is not None:
            ins = [input.shape[0] // size] * size
        if outs is None and ins is not None:
            outs = [output.shape[0] // size] * size

        def finish(works: list[Any]) -> Any:
            output.copy_(as_torch(works[0].result(), x.dtype).view(output.shape))
            return [output]
        return self._launch("all_to_all_single", input.device,
                            lambda g: [g.all_to_all(as_cupy(x), async_op=True, input_split_sizes=ins,
                                                    output_split_sizes=outs)], finish, [x, output])

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> CudaWork:
        root, mine = opts.rootRank, self._owner.rank() == opts.rootRank
        x = stage(inputs[0], "gather input").buf
        if mine:
            self._owner._check_list("gather", outputs[0], inputs[0])

        def finish(works: list[Any]) -> Any:
            rows = works[0].result()  # allocated by the NCCL backend: the host waits
            if mine:
                got = as_torch(rows, x.dtype)
                for i, t in enumerate(outputs[0]):
                    t.copy_(got[i].view(t.shape))
            return outputs
        return self._launch("gather", inputs[0].device, lambda g: [g.gather(as_cupy(x), root, async_op=True)], finish,
                            [x, *(outputs[0] if mine else [])])

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> CudaWork:
        root, out = opts.rootRank, outputs[0]
        x = None
        if self._owner.rank() == root:
            self._owner._check_list("scatter", inputs[0], out)
            x = torch.stack([stage(t, "scatter input").buf for t in inputs[0]])

        def finish(works: list[Any]) -> Any:
            out.copy_(as_torch(works[0].result(), out.dtype).view(out.shape))  # allocated: the host waits
            return [out]
        return self._launch("scatter", out.device,
                            lambda g: [g.scatter(None if x is None else as_cupy(x), root, async_op=True)], finish,
                            [out, *([] if x is None else [x])])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> CudaWork:
        staged = [stage(t, "send tensor") for t in tensors]
        return self._run("send", staged, lambda g: [g.isend(as_cupy(s.buf), dst, tag) for s in staged], tensors,
                         write=False)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> CudaWork:
        staged = [stage(t, "recv tensor") for t in tensors]
        return self._run("recv", staged, lambda g: [g.irecv(as_cupy(s.buf), src, tag) for s in staged], tensors)

    def abort(self, reason: str) -> None:
        """ncclCommAbort: later ops on the group raise; `shutdown` still releases it."""
        if self._group is not None:
            self._group.abort(reason)

    def shutdown(self) -> None:
        """Destroy the NCCL group (drains its stream, bounded by the group timeout); idempotent."""
        if self._group is not None:
            self._group.destroy()
            self._group = None
