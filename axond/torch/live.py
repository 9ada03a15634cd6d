"""torch DDP over "axond" that trains on through a rank's death: `Manager` (`axond worker --live-recovery`).

The shape is torchft's `Manager`: the loop asks `should_commit()` before the optimizer steps. A step is forward and
backward of this rank's share of a fixed number of *virtual* data-parallel ranks, inside `with manager.step()`:

    manager = Manager(model, optimizer, virtual_ranks=4)   # after dist.init_process_group("axond")
    while manager.current_step() < steps:
        with manager.step() as step:            # a membership change in here ends the block, caught
            for v in step.virtual_ranks():      # this rank's block of the virtual ranks
                x, y = batch(manager.current_step(), v)
                step.backward(loss_fn(manager.model(x), y))
        if manager.should_commit():             # every rank says the same; False: re-formed, run the step again
            optimizer.step()

When a peer leaves, the cut collective (DDP's gradient all-reduce, its buffer broadcast, the commit) raises on every
survivor; the manager catches it, re-forms torch's default group for the next generation (`axond.torch.reform`),
agrees with the others on the last committed step, and builds DDP again around the same module: the same process,
the same module and optimizer objects. The step that was cut runs again at the new world size.

The math: DDP averages the gradients over the physical ranks; each rank scales its loss by world / virtual ranks, so
the average is the mean over the virtual ranks of their gradients, whatever the world size (the float sums are
ordered differently at another world size: the same up to rounding, not bit for bit).

A node that joins the running job (a failed node's worker starting its rank again, or a new worker below `--nnodes`
MAX) joins at a step boundary: the running ranks' next collective is cut and they re-form at the larger size; the
new rank, running the same script, builds its `Manager`, and both take part in `axond.torch.join.settle`: the lowest
running rank sends the manager's state (committed steps, module and optimizer state dicts) over the data plane.

A step is applied on every rank or on none. After the backward, each rank all-reduces a commit flag (1: its part of
the step completed, so it holds the step's averaged gradient); a rank whose all-reduce completed with every rank's 1
commits. A rank whose all-reduce was cut while another's completed learns so after the re-formation (the ranks'
committed steps are gathered) and applies the gradient it holds; if none completed it, none applied it.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from axond.distributed import membership
from axond.errors import DistributedError, MembershipChanged
from axond.observe import timeline
from axond.parallel.zero.virtual import carried
from axond.torch.join import StateTransfer, check_live_store, settle
from axond.torch.reform import membership_change, reform_torch

__all__ = ["Manager", "Recovery", "Step", "batch_indices", "membership_change", "reform_torch"]

MAX_REFORMS = 8
"""Re-formations one recovery goes through (a further failure while re-forming starts another) before it raises."""


@dataclass(frozen=True)
class Recovery:
    """One re-formation the manager went through."""

    step: int
    """The step that was cut (the number of steps committed before it): it runs again."""
    world_before: int
    world_after: int
    generation: int
    reason: str
    """Who left and why (the coordinator's words)."""
    error_at: float
    """time.monotonic() when the step's failure was caught."""
    reformed_at: float
    """time.monotonic() when the group was formed again, the ranks agreed and DDP was rebuilt."""
    rolled_forward: bool
    """This rank applied the cut step after the re-formation (another rank's commit of it had completed)."""
    restored: int | None = None
    """FSDP2 (`ShardedManager`): the committed steps of the copy the state was rebuilt from (the steps after it run
    again from that state)."""


def batch_indices(length: int, batch: int, step: int, v: int, virtual: int, seed: int | None = None) -> torch.Tensor:
    """The indices (into a data set of `length` samples) of virtual rank `v`'s `batch` samples in `step`: step s reads
    positions [s x virtual x batch, (s + 1) x virtual x batch) of the epochs laid end to end, v its v-th slice; with
    `seed`, each epoch in its own order (a permutation seeded from (seed, epoch)). Defined on virtual ranks only, so
    the data do not move when the world size does."""
    if length < 1 or batch < 1 or not 0 <= v < virtual or step < 0:
        raise ValueError(f"batch_indices: need length >= 1, batch >= 1, 0 <= v < virtual, step >= 0; got "
                         f"length={length}, batch={batch}, step={step}, v={v}, virtual={virtual}")
    positions = torch.arange(batch, dtype=torch.int64) + (step * virtual + v) * batch
    epochs, within = positions // length, positions % length
    if seed is None:
        return within
    out = torch.empty_like(within)
    for epoch in torch.unique(epochs).tolist():
        order = torch.randperm(length, generator=torch.Generator().manual_seed(zlib.crc32(f"{seed}:{epoch}".encode())))
        mask = epochs == epoch
        out[mask] = order[within[mask]]
    return out


class Manager:
    """Torch DDP over the "axond" default group, kept training through membership changes of a live job.

    `module` is wrapped in `DistributedDataParallel(module, **ddp_options)` (use `manager.model`, rebuilt after each
    re-formation); `optimizer` steps `module`'s parameters. `virtual_ranks` (default: the most ranks the live job
    may grow to, `AXOND_LIVE_MAX_WORLD`, else the world size) fixes the global batch: a step is one micro-batch per
    virtual rank. With `seed`, torch's global generator is seeded from (seed, step, virtual rank) before each
    micro-batch, so that dropout draws the same numbers whichever physical rank carries it. `apply_step` is what
    applying a step is (default `optimizer.step`; pass your own when it also clips the gradients or steps a learning
    rate scheduler, and call the same after `should_commit()`): the manager calls it itself for a step another rank
    committed while this rank's commit was cut.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, virtual_ranks: int | None = None,
                 seed: int | None = None, apply_step: Callable[[], Any] | None = None, **ddp_options: Any) -> None:
        if not dist.is_initialized():
            raise DistributedError("axond.torch.live.Manager: torch's default group is not formed; call "
                                   "torch.distributed.init_process_group(\"axond\") first", op="live manager")
        world = dist.get_world_size()
        live = membership.current()
        virtual = virtual_ranks or max(world, live.max_world if live is not None else 0)
        if virtual < world:
            raise ValueError(f"virtual_ranks={virtual} is fewer than the {world} ranks of the group; each rank "
                             "carries at least one virtual rank")
        if "process_group" in ddp_options:
            raise ValueError("Manager re-forms torch's default group and builds DDP on it: pass no process_group")
        self.module = module
        self.optimizer = optimizer
        self.virtual = virtual
        self.seed = seed
        self.apply_step = apply_step if apply_step is not None else self._optimizer_step
        self.recoveries: list[Recovery] = []
        self.loss: float | None = None
        """The mean over the virtual ranks of the losses passed to `Step.backward` in the last committed step
        (None if this rank applied it after a re-formation, without the others' losses)."""
        self.transfers: list[StateTransfer] = []
        """The state sent to ranks that joined the running job (or, on a joining rank, the state it took)."""
        self._ddp_options = ddp_options
        self._wrapped: torch.nn.Module | None = None
        self._committed = 0
        self._pending = False
        """This rank's part of the current step completed: it holds the step's averaged gradient."""
        self._failure: MembershipChanged | None = None
        self._failed_at = 0.0
        self._failed_ns = 0
        self._loss_sum = 0.0
        if live is not None:  # a rank that joins a running job takes the state here (its first generation: nothing)
            check_live_store()
            self._join()
        self._wrapped = self._wrap()

    @property
    def model(self) -> Any:
        """DDP around the module, over the current generation's default group (call it anew every step)."""
        if self._wrapped is None:
            raise DistributedError("the manager's model is being rebuilt after a membership change; call "
                                   "should_commit() after the step", op="live manager")
        return self._wrapped

    def _optimizer_step(self) -> None:
        self.optimizer.step()

    def _wrap(self) -> torch.nn.Module:
        """The model the loop calls, over the current default group."""
        return DistributedDataParallel(self.module, **self._ddp_options)

    def _set_sync(self, sync: bool) -> None:
        """Whether the next backward synchronises the gradients (the last of this rank's virtual ranks)."""
        if isinstance(self._wrapped, DistributedDataParallel):
            self._wrapped.require_backward_grad_sync = sync  # what DDP's no_sync() sets

    def _passes(self, block: range) -> int:
        """Forward and backward passes this rank runs per step: one per virtual rank it carries."""
        return len(block)

    def _before_step(self) -> None:
        """Called as a step begins (inside its failure handling)."""

    def _drop(self) -> None:
        """Let go of the model of the old generation."""
        if isinstance(self._wrapped, DistributedDataParallel):
            self._wrapped._remove_autograd_hooks()  # the old reducer's hooks would run on the old group
        self._wrapped = None

    def current_step(self) -> int:
        """Steps committed so far (the number of the step to run next, from 0)."""
        return self._committed

    def world_size(self) -> int:
        return dist.get_world_size()

    def rank(self) -> int:
        return dist.get_rank()

    def virtual_ranks(self) -> range:
        """The virtual ranks this rank carries: a contiguous block, sizes differing by at most one."""
        return carried(dist.get_rank(), dist.get_world_size(), self.virtual)

    def batch_indices(self, length: int, batch: int, v: int) -> torch.Tensor:
        """`batch_indices` of virtual rank `v` in the current step, shuffled per epoch with the manager's `seed`."""
        return batch_indices(length, batch, self._committed, v, self.virtual, self.seed)

    def state_dict(self) -> dict[str, Any]:
        """The training state to checkpoint (for a job that restarts all the same): the committed steps, the module's
        and the optimizer's state dicts."""
        return {"step": self._committed, "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take `state_dict()`'s state back (every rank, before its first step)."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._committed = int(state["step"])

    def step(self) -> Step:
        """The context of one step's forward and backward (see the module docstring)."""
        return Step(self)

    def should_commit(self) -> bool:
        """Whether every rank completed this step: True on every rank or on none (then the group was re-formed and
        the same step runs again). Raises the step's own failure when it was not a membership change."""
        if self._failure is None:
            world = dist.get_world_size()
            flag = torch.tensor([1.0 if self._pending else 0.0, self._loss_sum], dtype=torch.float64)
            try:
                dist.all_reduce(flag)
                if int(flag[0]) == world:
                    self._committed += 1
                    self._pending = False
                    self.loss = float(flag[1]) / self.virtual
                    return True
                cause: BaseException = DistributedError(
                    f"step {self._committed}: {int(flag[0])} of {world} ranks completed it (run each step's forward "
                    "and backward inside `with manager.step()`, on every rank)", op="commit")
            except Exception as e:  # noqa: BLE001 - told from a failure of its own just below
                cause = e
            if not self._caught(cause):
                raise cause
        self._recover()
        return False

    def _caught(self, error: BaseException) -> bool:
        """Keep `error` as the step's membership change; False: it is a failure of its own (the caller raises it)."""
        change = membership_change(error)
        if change is None:
            return False
        self._failure = change
        self._failed_at, self._failed_ns = time.monotonic(), timeline.span_start()
        if self._wrapped is not None:
            self._set_sync(True)
        return True

    def _recover(self) -> None:
        """Re-form, agree on the last committed step (applying it here if it was committed elsewhere), rebuild DDP."""
        change = self._failure
        assert change is not None
        cut, before = self._committed, dist.get_world_size()
        for _ in range(MAX_REFORMS):
            try:
                if self._wrapped is not None:
                    self._drop()
                note = reform_torch()
                rolled = self._agree()
                self._wrapped = self._wrap()
                break
            except Exception as e:
                again = membership_change(e)
                if again is None:
                    raise
                change = again
        else:
            raise DistributedError(f"live recovery gave up after {MAX_REFORMS} re-formations in a row ({change})",
                                   op="reform") from change
        restored = self._restored_from()
        if timeline.TRACER is not None:  # from the caught failure to the rebuilt wrapper (AXOND_TIMELINE)
            timeline.TRACER.since("live.reform", "live", self._failed_ns, step=cut, world_before=before,
                                  world_after=note.world_size, generation=note.generation, reason=change.reason,
                                  rolled_forward=rolled, restored=restored)
        self.recoveries.append(Recovery(cut, before, note.world_size, note.generation, change.reason,
                                        self._failed_at, time.monotonic(), rolled, restored))
        self._failure = None
        self._pending = False

    def _agree(self) -> bool:
        """Gather every rank's committed steps; apply the cut step here if another rank committed it; send the state
        to ranks that joined (`axond.torch.join.settle`)."""
        rolled, moved = settle(self, fresh=False)
        if moved is not None:
            self.transfers.append(moved)
        return rolled

    def _restored_from(self) -> int | None:
        return None

    def _copy_tags(self) -> tuple[int, int]:
        """The newest and oldest copy of the state this rank keeps (-1: none; `ShardedManager` keeps copies)."""
        return -1, -1

    def _resize(self, virtual: int) -> None:
        """Train `virtual` virtual ranks (the running ranks' number, taken by a joining rank)."""
        world = dist.get_world_size()
        if world > virtual:
            raise DistributedError(f"the job has {world} ranks but trains {virtual} virtual ranks (each rank carries "
                                   "at least one): pass Manager(virtual_ranks=...) at least the job's largest world "
                                   "size (--nnodes MAX x --nproc-per-node) when it may grow", op="join",
                                   rank=dist.get_rank())
        self.virtual = virtual

    def _receive_into(self) -> dict[str, Any] | None:
        """Where a received state lands in place where alike: this rank's own (its parameters)."""
        return self.state_dict()

    def _take(self, state: dict[str, Any]) -> None:
        """A joining rank makes the state received from a live peer its own (its parameters were filled in place)."""
        own = self.module.state_dict()
        if any(k not in own or own[k].data_ptr() != v.data_ptr() for k, v in state["model"].items()):
            self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._committed = int(state["step"])
        self.loss = None

    def _join(self) -> None:
        """As the manager is built in a live job: take part in the state's transfer to the ranks that start in this
        generation (`axond.torch.join`); when a running rank is lost meanwhile, re-form and take the next one's."""
        for _ in range(MAX_REFORMS):
            try:
                _, moved = settle(self, fresh=True)
            except Exception as e:
                if membership_change(e) is None:
                    raise
                reform_torch()
                continue
            if moved is not None:
                self.transfers.append(moved)
            return
        raise DistributedError(f"joining a running job: the group re-formed {MAX_REFORMS} times before the state "
                               "arrived", op="join")

    def _seed(self, v: int) -> None:
        if self.seed is not None:
            torch.manual_seed(zlib.crc32(f"{self.seed}:{self._committed}:{v}".encode()))


class Step:
    """One step's forward and backward; a membership change inside it is caught (`Manager.step`)."""

    def __init__(self, manager: Manager) -> None:
        self.manager = manager
        self._padding = False

    def __enter__(self) -> Step:
        m = self.manager
        m._failure, m._pending, m._loss_sum = None, False, 0.0
        m.optimizer.zero_grad(set_to_none=True)
        try:
            m._before_step()
        except Exception as e:
            if not m._caught(e):
                raise
        return self

    def virtual_ranks(self) -> Iterator[int]:
        """This rank's virtual ranks, in order; DDP all-reduces the gradients after the last one's backward only."""
        m = self.manager
        if m._failure is not None:  # the step's beginning failed: nothing to run, should_commit() re-forms
            return
        block = m.virtual_ranks()
        passes = m._passes(block)
        try:
            for i in range(passes):
                v = block[min(i, len(block) - 1)]
                self._padding = i >= len(block)  # an extra pass of a wrapper that needs as many on every rank
                m._set_sync(i == passes - 1)
                m._seed(v)
                yield v
        finally:
            self._padding = False
            if m._wrapped is not None:
                m._set_sync(True)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss` (one virtual rank's) backward, scaled so that DDP's average is the mean over the virtual ranks."""
        m = self.manager
        if self._padding:  # its collectives run, its gradient counts for nothing
            (loss * 0.0).backward()
            return
        m._loss_sum += float(loss.detach())
        (loss * (dist.get_world_size() / m.virtual)).backward()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        m = self.manager
        if error is None:
            m._pending = m._failure is None
            return False
        return isinstance(error, Exception) and m._caught(error)  # a failure of its own goes on up
