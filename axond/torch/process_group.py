"""`AxondProcessGroup`: a `torch.distributed.ProcessGroup` whose collectives run on an axond group.

torch's wrappers (DDP, FSDP2, DTensor, pipelining, the object collectives) call these methods with
their option structs; each one takes NumPy views of the tensors (see `axond.torch.tensors`),
starts axond async ops and returns a torch `Work` completed by them (see `axond.torch.completion`).
Ranks in the options (rootRank, dstRank, srcRank) are group ranks, as axond's group methods take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from itertools import accumulate
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from axond.distributed.backends.base import BackendOptions
from axond.distributed.backends.registry import DEFAULT
from axond.distributed.process_group import ASYNC_MARGIN, ProcessGroup, create_group
from axond.distributed import membership
from axond.errors import DistributedError, StoreError
from axond.store import Store
from axond.torch.completion import AxondWork, Completer, Posted
from axond.torch.errors import TorchTimeoutError, for_torch
from axond.torch.identity import TorchBackendIdentity
from axond.torch.launching import Launching, overlaps
from axond.torch.reduce_ops import premultiplied, reduction
from axond.torch.sparse import sparse_all_reduce
from axond.torch.tensors import Staged, copy_into, readonly, stage

BACKEND = "axond"
class AxondProcessGroup(TorchBackendIdentity, Launching, dist.ProcessGroup):
    """A torch ProcessGroup over one axond `ProcessGroup` (built from torch's store on first use)."""

    def __init__(self, store: Store, rank: int, size: int, options: BackendOptions) -> None:
        super().__init__(rank, size)
        self._store = store
        self._rank = rank
        self._size = size
        self._options = options
        self._group: ProcessGroup | None = None
        self._group_name = ""
        self._completer: Completer | None = None
        self._seq = 0
        """Ops started on this group (`_get_sequence_number_for_group`)."""
        self._overlap = options.runtime_env().torch_overlap
        """Whether async collectives over SYNC_BYTES run on the communication thread (None: decided with the group)."""

    @property
    def axond_group(self) -> ProcessGroup:
        """The axond group doing the work; created (a rendezvous of every member) on first use."""
        if self._group is None:
            name = f"torch:{self._group_name}" if self._group_name else "torch"
            try:
                kind = self._options.runtime_env().torch_backend or DEFAULT  # AXOND_TORCH_BACKEND
                self._group = create_group(self._store, self._rank, self._size, kind, self._options, name=name)
            except DistributedError as e:  # inside torch's init_process_group / new_group: torch's error classes
                raise for_torch(e, self._options.timeout) from e
            self._completer = Completer(name, self._options.timeout + ASYNC_MARGIN, self._options.timeout)
            if self._overlap is None:
                backend = self._group.backend
                assert backend is not None  # every member of the torch group is a member of its axond group
                self._overlap = overlaps(backend.host_ranks, backend.host_cores, torch.get_num_threads())
        return self._group

    @property
    def overlap(self) -> bool:
        """Whether async collectives over SYNC_BYTES run on the communication thread, overlapping the caller's
        computation (AXOND_TORCH_OVERLAP; by default only where every rank on the host has a core to spare beside
        its torch threads, `overlaps`); else they run on the calling thread and come back completed."""
        self.axond_group  # noqa: B018 -- decided with the group
        return bool(self._overlap)

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self.axond_group  # noqa: B018
        self._overlap = bool(value)

    def _set_group_name(self, name: str) -> None:
        """torch names every group right after creating it; the axond group is created under that name. In a live job
        whose generation is over by the time the group forms (its store refuses, its peers never come: a rank that
        joins the running job starts slowly, and another node failed or joined meanwhile), the group is left unformed
        once the worker says so: its first collective raises, and `axond.torch.live` re-forms for the later
        generation, so that the rank neither fails nor moves the job on again."""
        self._group_name = name
        try:
            self.axond_group  # noqa: B018 -- rendezvous now, inside torch's init/new_group, like gloo does
        except (DistributedError, StoreError):
            live = membership.current()
            if live is None:
                raise
            membership.nudge(live.path)
            if live.wait(live.wait_s) is None:
                raise

    @property
    def group_name(self) -> str:
        return self._group_name

    def name(self) -> str:
        return BACKEND

    def getBackendName(self) -> str:  # noqa: N802 -- torch's name
        return BACKEND

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"AxondProcessGroup({self._group_name!r}, rank={self._rank}, size={self._size})"

    def _same_dtype(self, where: str, *tensors: torch.Tensor) -> None:
        kinds = {t.dtype for t in tensors}
        if len(kinds) > 1:
            raise TypeError(f"{where} on group '{self._group_name}': tensors have different dtypes {sorted(map(str, kinds))}")

    def _check_whole_and_part(self, op: str, whole: torch.Tensor, part: torch.Tensor, whole_name: str,
                              part_name: str) -> None:
        """The group-sized tensor of a flat all_gather / reduce_scatter holds `size` parts, in the part's dtype."""
        self._same_dtype(op, whole, part)
        if whole.numel() != part.numel() * self._size:
            raise ValueError(f"{op} on group '{self._group_name}': {whole_name} has {whole.numel()} elements, needs "
                             f"{self._size} x {part.numel()} (group size x {part_name})")

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op, factor = reduction(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "allreduce")
        if len(tensors) == 1 and factor is None and self._at_once(tensors[0], opts):
            return self._run_at_once("allreduce", self.axond_group.all_reduce, tensors, op)
        if any(t.layout is torch.sparse_coo for t in tensors):  # as gloo: indices and values gathered, summed
            if factor is not None:
                raise ValueError("allreduce: sparse tensors take ReduceOp.SUM only (as gloo), not PREMUL_SUM")
            return self._launch("allreduce", [lambda async_op, t=t: sparse_all_reduce(
                self.axond_group, t, op, f"allreduce on group '{self._group_name}'") for t in tensors],
                lambda _: tensors, 0, opts)
        staged = [stage(t, "allreduce tensor", reduce=True) for t in tensors]
        calls = [partial(self.axond_group.all_reduce, premultiplied(s.array, factor, True), op) for s in staged]
        return self._launch("allreduce", calls, _written(staged, tensors), _nbytes(tensors), opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        if len(tensors) == 1 and self._at_once(tensors[0], opts):
            return self._run_at_once("broadcast", self.axond_group.broadcast, tensors, root)
        staged = [stage(t, "broadcast tensor") for t in tensors]
        calls = [partial(self.axond_group.broadcast, s.array, root) for s in staged]
        return self._launch("broadcast", calls, _written(staged, tensors), _nbytes(tensors), opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op, factor = reduction(opts.reduceOp, "reduce")
        staged = [stage(t, "reduce tensor", reduce=True) for t in tensors]
        calls = [partial(self.axond_group.reduce, premultiplied(s.array, factor, True), opts.rootRank, op) for s in staged]
        return self._launch("reduce", calls, _written(staged if self._rank == opts.rootRank else [], tensors),
                            _nbytes(tensors), opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None,
                  op: str = "allgather", value: Any = None) -> Any:
        """outputs[j][r] receives rank r's inputs[j] (torch's `all_gather` layout: one list per input)."""
        if len(outputs) != len(inputs):
            raise ValueError(f"{op} on group '{self._group_name}': {len(inputs)} inputs but {len(outputs)} output "
                             "lists")
        works, copies = [], []
        for outs, t in zip(outputs, inputs):
            self._check_list(op, outs, t)
            x = readonly(t, f"{op} input")
            gathered = np.empty((self._size, *x.shape), x.dtype)
            works.append(partial(self.axond_group.all_gather, x, out=gathered))
            copies.append((outs, gathered))
        result = outputs if value is None else value
        return self._launch(op, works, lambda _: _scatter_rows(copies, result), _nbytes(inputs) * self._size, opts)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Any:
        """torch's `all_gather_coalesced` layout, the transpose of `allgather`'s: outputs[r][j] receives rank r's
        inputs[j] (one list per rank, each as long as `inputs`)."""
        if len(outputs) != self._size or any(len(outs) != len(inputs) for outs in outputs):
            raise ValueError(f"all_gather_coalesced on group '{self._group_name}': needs {self._size} output lists "
                             f"(one per rank) of {len(inputs)} tensors (one per input), got "
                             f"{[len(outs) for outs in outputs]}")
        per_input = [[outputs[r][j] for r in range(self._size)] for j in range(len(inputs))]
        return self.allgather(per_input, inputs, opts, op="allgather_coalesced", value=outputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        staged, works = [], []
        for out, t in zip(outputs, inputs):
            self._check_whole_and_part("all_gather_into_tensor", out, t, "output", "input")
            x = readonly(t, "all_gather_into_tensor input").reshape(-1)
            s = stage(out, "all_gather_into_tensor output")
            works.append(partial(self.axond_group.all_gather, x, out=s.array.reshape(self._size, -1)))
            staged.append(s)
        return self._launch("allgather_into_tensor_coalesced", works, _written(staged, outputs), _nbytes(outputs),
                            opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced
    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        op, factor = reduction(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter")
        staged, works = [], []
        for out, ins in zip(outputs, inputs):
            self._check_list("reduce_scatter", ins, out)
            x = np.stack([readonly(t, "reduce_scatter input", reduce=True).reshape(-1) for t in ins])
            x = premultiplied(x, factor, True)  # the stacked copy is this op's own
            s = stage(out, "reduce_scatter output", reduce=True)
            works.append(partial(self.axond_group.reduce_scatter, x, op, out=s.array.reshape(1, -1)))
            staged.append(s)
        return self._launch("reduce_scatter", works, _written(staged, outputs), _nbytes(outputs) * self._size, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        op, factor = reduction(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter_tensor")
        staged, works = [], []
        for out, t in zip(outputs, inputs):
            self._check_whole_and_part("reduce_scatter_tensor", t, out, "input", "output")
            x = premultiplied(readonly(t, "reduce_scatter_tensor input", reduce=True).reshape(self._size, -1), factor,
                               False)  # the caller's input stays as it was
            s = stage(out, "reduce_scatter_tensor output", reduce=True)
            works.append(partial(self.axond_group.reduce_scatter, x, op, out=s.array.reshape(1, -1)))
            staged.append(s)
        return self._launch("reduce_scatter_tensor_coalesced", works, _written(staged, outputs), _nbytes(inputs),
                            opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    _reduce_scatter_base = reduce_scatter_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        self._same_dtype("all_to_all", *outputs, *inputs)
        if len(outputs) != self._size or len(inputs) != self._size:
            raise ValueError(f"all_to_all on group '{self._group_name}': needs {self._size} input and output "
                             f"tensors (one per rank), got {len(inputs)} and {len(outputs)}")
        x = np.concatenate([readonly(t, "all_to_all input").reshape(-1) for t in inputs])
        ins, outs = [t.numel() for t in inputs], [t.numel() for t in outputs]
        work = partial(self.axond_group.all_to_all, x, input_split_sizes=ins, output_split_sizes=outs)
        starts = [0, *accumulate(outs)]

        def finish(results: list[Any]) -> list[torch.Tensor]:
            for i, t in enumerate(outputs):
                copy_into(t, results[0][starts[i]:starts[i + 1]])
            return outputs

        return self._launch("alltoall", [work], finish, _nbytes(inputs), opts)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> Any:
        self._same_dtype("all_to_all_single", output, input)
        x = readonly(input, "all_to_all_single input")
        ins = list(input_split_sizes) or None
        outs = list(output_split_sizes) or None
        if ins is None and outs is not None:
            ins = [input.shape[0] // self._size] * self._size
        if outs is None and ins is not None:
            outs = [output.shape[0] // self._size] * self._size
        work = partial(self.axond_group.all_to_all, x, input_split_sizes=ins, output_split_sizes=outs)
        return self._launch("all_to_all_single", [work], lambda results: _copied(output, results[0]),
                            _nbytes([input]), opts)

    alltoall_base = all_to_all_single

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank
        x = readonly(inputs[0], "gather input")
        if self._rank == root:
            self._check_list("gather", outputs[0], inputs[0])
        work = partial(self.axond_group.gather, x, root)
        size = _nbytes(inputs) * self._size
        if self._rank != root:
            return self._launch("gather", [work], lambda _: outputs, size, opts)
        return self._launch("gather", [work], lambda results: _scatter_rows([(outputs[0], results[0])], outputs),
                            size, opts)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        root = opts.rootRank
        x = None
        if self._rank == root:
            self._check_list("scatter", inputs[0], outputs[0])
            x = np.stack([readonly(t, "scatter input") for t in inputs[0]])
        work = partial(self.axond_group.scatter, x, root)
        return self._launch("scatter", [work], lambda results: [_copied(outputs[0], results[0])],
                            _nbytes(outputs) * self._size, opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        """Posted at once on the calling thread, never behind this group's queued receives (so isend/irecv and
        batch_isend_irecv never deadlock, in any order); its Work completes once the bytes left."""
        arrays = [readonly(t, "send tensor") for t in tensors]
        limit = self._options.timeout + ASYNC_MARGIN
        return self._launch_started("send", lambda: [Posted(self.axond_group.post_send(x, dst, tag), limit)
                                                     for x in arrays], lambda _: tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        staged = [stage(t, "recv tensor") for t in tensors]
        return self._launch_started("recv", lambda: [self.axond_group.irecv(s.array, src, tag) for s in staged],
                                    _written(staged, tensors))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        """torch's `recv(t)` / `irecv(t)` without src: the first send of `tag` from any member; the Work's
        `_source_rank()` names the sender (torch's `recv` returns it)."""
        if len(tensors) != 1:
            raise ValueError(f"recv from any source on group '{self._group_name}': takes one tensor, got "
                             f"{len(tensors)}")
        staged = stage(tensors[0], "recv tensor")
        sender: list[int] = []

        def finish(results: list[Any]) -> list[torch.Tensor]:
            staged.write_back()
            sender.append(int(results[0]))
            return tensors

        work = self._launch_started("recv_anysource", lambda: [self.axond_group.recv_any(staged.array, tag, True)],
                                    finish)
        if isinstance(work, AxondWork):
            work.source = sender
        return work

    def barrier(self, opts: Any = None) -> Any:
        return self._launch("barrier", [self.axond_group.barrier], lambda _: [], 0, opts)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """axond's `monitored_barrier` through the store (group rank 0 names the ranks that did not arrive within
        `timeout`, a timedelta or seconds; default the group's). torch's `dist.monitored_barrier` refuses every
        backend but gloo by name, so call it on the group: `dist.group.WORLD.monitored_barrier(timeout)`."""
        seconds = None if timeout is None else timeout_seconds(timeout)
        if seconds is not None and seconds <= 0 and self._size > 1:  # gloo's answer to a zero timeout: at once
            raise TorchTimeoutError(f"Rank {self._rank} timed out in monitoredBarrier after 0 ms (a timeout of 0 "
                                    f"on group '{self._group_name}')", op="monitored_barrier", group=self._group_name,
                                    rank=self._rank, timed_out=True)
        try:
            self.axond_group.monitored_barrier(seconds, wait_all_ranks)
        except DistributedError as e:
            error = for_torch(e)
            if e.peer is not None and seconds is not None:  # gloo's wording first, as for every timeout
                error.args = (f"[Rank {self._rank}]: Rank {e.peer} failed to pass monitoredBarrier in "
                              f"{round(seconds * 1000)} ms: {e}",)
            raise error from None

    def _check_list(self, where: str, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> None:
        if len(tensors) != self._size:
            raise ValueError(f"{where} on group '{self._group_name}': needs a list of {self._size} tensors "
                             f"(one per rank), got {len(tensors)}")
        for t in tensors:
            if t.dtype != like.dtype or t.numel() != like.numel():
                raise ValueError(f"{where} on group '{self._group_name}': list tensors must match the other tensor "
                                 f"({like.dtype}, {like.numel()} elements), got {t.dtype} with {t.numel()}")

    def shutdown(self) -> None:
        """Close the axond group's sockets and threads (torch's destroy_process_group calls it)."""
        if self._completer is not None:
            self._completer.close(self._options.timeout)
        if self._group is not None:
            self._group.destroy()

    def abort(self) -> None:
        """Tell the peers this rank gave up, then close."""
        if self._group is not None:
            self._group.abort(f"rank {self._rank} aborted its torch process group")
        self.shutdown()


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _written(staged: list[Staged], value: Any) -> Callable[[list[Any]], Any]:
    """A finisher that copies each stand-in back into its tensor and returns `value`."""
    def finish(_: list[Any]) -> Any:
        for s in staged:
            s.write_back()
        return value
    return finish


def _scatter_rows(copies: Sequence[tuple[Sequence[torch.Tensor], np.ndarray]], value: Any) -> Any:
    """Copy row i of each gathered array into tensor i of its list; return `value`."""
    for outs, rows in copies:
        for i, t in enumerate(outs):
            copy_into(t, rows[i])
    return value


def _copied(dst: torch.Tensor, src: np.ndarray) -> torch.Tensor:
    """Copy `src` into `dst`; return `dst`."""
    copy_into(dst, src)
    return dst


def timeout_seconds(timeout: timedelta | float | None, default: float = 300.0) -> float:
    """Seconds of torch's timeout argument (a timedelta, seconds, or None for axond's default)."""
    if timeout is None:
        return default
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
