"""`ParameterServer`: the first `num_servers` ranks of a group hold the parameters (one contiguous shard each,
with its optimizer state) and apply updates; the other ranks are workers that compute gradients.

Synchronous mode (`"sync"`): every worker step, each server sums the workers' gradient slices (a `reduce`
to it over its own group: the server and every worker), averages them over the workers, steps its
optimizer, and broadcasts the new slice back. With the same data per worker this is DDP with the workers
as ranks: the parameters match DDP's (tested).

Asynchronous mode (`"async"`): no step waits for every worker. Each worker sends its gradient slices to
the servers and waits only for its own fresh parameters; a server applies the workers' gradients one at a
time, in worker order, each scaled by 1/workers (so one round of updates moves as far as one sync step).
Staleness bound: a gradient is applied after at most `workers - 1` other updates since the parameters
it was computed on (each worker pulls fresh parameters after every push, and a server serves the
workers in turn). The order is fixed, so runs are deterministic.

Data moves over the data plane (tcp or nccl); nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

from axond.distributed.process_group import ProcessGroup
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.work import Work
from axond.nn.device import Array, empty_on
from axond.nn.module import Module, Parameter
from axond.nn.optim import Optimizer
from axond.parallel.fsdp.comm import default_group
from axond.parallel.fsdp.flat_param import FlatLayout

PSMode = Literal["sync", "async"]

GRAD_TAG, PARAM_TAG = 11, 12
"""Point-to-point tags of async mode: gradient slices to a server, parameter slices back."""


class ParameterServer:
    """Run `model` with `num_servers` server ranks and the rest as workers (see the module doc).

    Every rank builds it with the same model (the initial parameters are taken from group rank 0).
    Servers call `serve(steps)`; workers run their loop, calling `model.backward(...)` and then
    `step()` once per batch, `steps` times.
    """

    def __init__(
        self,
        model: Module,
        optimizer_factory: Callable[[Iterable[Parameter]], Optimizer],
        group: ProcessGroup | None = None,
        num_servers: int = 1,
        mode: PSMode = "sync",
    ) -> None:
        self.group: ProcessGroup = group if group is not None else default_group()
        size = self.group.size
        if not 1 <= num_servers < size:
            raise ValueError(f"num_servers is {num_servers}; it must be in 1..{size - 1} (a group of {size} needs "
                             "at least one worker)")
        if mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
        params = list(model.parameters())
        if not params or len({p.data.dtype for p in params}) != 1:
            raise ValueError("ParameterServer needs a model whose parameters all have one dtype")
        self.model, self.mode, self.num_servers = model, mode, num_servers
        self.workers = size - num_servers
        self.params = params
        self.layout = FlatLayout([p.shape for p in params], num_servers)
        self.flat = self.layout.flatten([p.data for p in params], params[0].data)
        for p, view in zip(params, self.layout.views(self.flat)):
            p.data = view
        self.group.broadcast(self.flat, src=0)
        self.is_server = self.group.rank < num_servers
        self.slices = [self.flat[slice(*self.layout.shard_range(s))] for s in range(num_servers)]
        self._grad = empty_on(self.flat, self.flat.size, self.flat.dtype)
        worker_ranks = list(range(num_servers, size))
        self._groups: list[tuple[ProcessGroup, int]] = []
        """Sync mode: per server, its group (the server and every worker) and the server's rank in it."""
        if mode == "sync":
            global_ranks = self.group.ranks
            for s in range(num_servers):
                sub = self.group.new_group([global_ranks[s]] + [global_ranks[w] for w in worker_ranks])
                self._groups.append((sub, sub.group_rank(global_ranks[s])))
        self.optimizer: Optimizer | None = None
        if self.is_server:
            self.shard = Parameter(self.slices[self.group.rank])
            self.optimizer = optimizer_factory([self.shard])
        self.steps_done = 0

    def step(self) -> None:
        """Worker: push this step's gradients to the servers and pull the updated parameters."""
        if self.is_server:
            raise RuntimeError("step() is for workers; server ranks call serve(steps)")
        grad = self.layout.copy_range([p.grad for p in self.params], 0, self.flat.size, self._grad)
        gslices = [grad[slice(*self.layout.shard_range(s))] for s in range(self.num_servers)]
        if self.mode == "sync":
            pushes = [g.reduce(gs, dst=root, op=ReduceOp.SUM, async_op=True)
                      for (g, root), gs in zip(self._groups, gslices)]
            _wait_all(pushes)
            _wait_all([g.broadcast(ps, src=root, async_op=True) for (g, root), ps in zip(self._groups, self.slices)])
        else:
            sends = [self.group.isend(gs, s, tag=GRAD_TAG) for s, gs in enumerate(gslices)]
            for s, ps in enumerate(self.slices):
                self.group.recv(ps, s, tag=PARAM_TAG)
            for work in sends:
                work.wait()
        self.steps_done += 1

    def serve(self, steps: int) -> None:
        """Server: apply the workers' updates for `steps` worker steps, then return."""
        if not self.is_server or self.optimizer is None:
            raise RuntimeError("serve() is for server ranks (group rank < num_servers); workers call step()")
        me = self.group.rank
        buf: Array = empty_on(self.shard.data, self.shard.data.size, self.shard.data.dtype)
        for _ in range(steps):
            if self.mode == "sync":
                g, root = self._groups[me]
                buf[...] = 0
                g.reduce(buf, dst=root, op=ReduceOp.SUM)
                self._apply(buf)
                g.broadcast(self.shard.data, src=root)
            else:
                for w in range(self.num_servers, self.group.size):
                    self.group.recv(buf, w, tag=GRAD_TAG)
                    self._apply(buf)
                    self.group.send(self.shard.data, w, tag=PARAM_TAG)
            self.steps_done += 1

    def _apply(self, summed: Array) -> None:
        if self.optimizer is not None:
            self.shard.grad = summed / self.workers
            self.optimizer.step()


def _wait_all(works: list[Work | None]) -> None:
    for work in works:
        if work is not None:
            work.wait()
