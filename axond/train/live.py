"""Data-parallel steps on virtual ranks that survive a membership change (`DistributedTrainer`, parallel="ddp",
"zero" or "fsdp").

Each step: every virtual rank this process carries runs its micro-batches (its data shard, its random stream), its
gradient and loss go into its row; one all_gather brings every row and the rows are averaged in virtual-rank
order (`axond.train.virtual`); a barrier commits; then the optimizer steps. If a collective raises
`MembershipChanged` (a node left a live job), the step is not applied: `axond.reform()` takes the new generation,
the surviving ranks agree on the last committed step, and the cut step runs again with the virtual ranks spread
over the new world. A step is applied on every rank or none: a rank that completed the commit knows every rank
entered it, so every rank holds that step's averaged gradient; a rank the failure cut after its gather applies it
then ("rolls forward"), and none is ever applied twice.

Under ZeRO-1 (`axond.parallel.zero.virtual`) each rank steps the optimizer for its block of virtual shards, then the
blocks are all-gathered; each rank's block is copied into its worker daemon's memory (`axond.train.daemon_copy`) and
to a buddy (`axond.train.buddy`: the buddy node's worker, `axond.train.relay`, under worker daemons) and, after a
re-formation, the shards are rebuilt at the agreed step from the survivors and the copies and re-sharded over the new
world (`axond.train.reassemble`; where the copies go: `axond.train.live_copies`). FSDP on virtual ranks
(`axond.parallel.fsdp.virtual`) is ZeRO-1's layout and recovery with the gradient reduce-scattered in virtual-rank
order (`axond.train.sharded`) instead of gathered whole.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from axond.checkpoint.api import ObjectCollectives
from axond.config import RuntimeEnv
from axond.distributed.boundary import moved_on
from axond.distributed.diagnostics.steps import mark_step
from axond.distributed.reform import reform
from axond.errors import DistributedError, MembershipChanged
from axond.nn.module import Module
from axond.observe import timeline
from axond.parallel import DistributedSampler
from axond.train import join
from axond.train.agreed import AgreedState
from axond.parallel.fsdp.virtual import VirtualFSDP
from axond.parallel.zero.virtual import VirtualZero
from axond.train.buddy import BuddyCopies
from axond.train.daemon_copy import DaemonCopy
from axond.train.live_copies import LiveCopies
from axond.train.progress import Progress
from axond.train.relay import RelayedCopies
from axond.train.sharded import ShardedGradients
from axond.train.virtual import VirtualGradients

if TYPE_CHECKING:
    from axond.train.trainer import DistributedTrainer

MAX_REFORMS_PER_STEP = 8
"""Re-formations one step may go through (each after another node left) before the trainer gives up."""


@dataclass(frozen=True)
class Recovery:
    """One re-formation the trainer went through."""

    step: int
    """The global step that was cut (and run again)."""
    world_before: int
    world_after: int
    generation: int
    reason: str
    error_at: float
    """time.monotonic() when the collective raised `MembershipChanged`."""
    reformed_at: float
    """time.monotonic() when the new group was formed and the ranks agreed on the step."""
    rolled_forward: bool
    """This rank applied the cut step's gradient after the re-formation (it had been committed elsewhere)."""
    from_copies: tuple[int, ...] = ()
    """ZeRO-1 and FSDP: the virtual shards rebuilt from buddy copies (in memory, nothing read from storage)."""
    replayed: tuple[int, ...] = ()
    """ZeRO-1: of `from_copies`, the shards whose copy was of the step before, advanced by the gradients kept since."""
    checkpoint: str | None = None
    """ZeRO-1 and FSDP: the checkpoint read instead, when both copies of a shard were lost."""
    from_daemon: tuple[int, ...] = ()
    """ZeRO-1: of `from_copies`, the shards whose copy came from a worker daemon's memory (a replacement rank's)."""


def roll_forward(steps: Sequence[int], mine: int, pending: bool) -> bool:
    """After a re-formation, from every rank's count of applied steps: whether this rank (at `mine`, holding the cut
    step's gradient when `pending`) must apply that step now, because another rank's commit of it completed.
    Raises `DistributedError` when the counts cannot come from one cut step (a bug, never silently trained on)."""
    newest, oldest = max(steps), min(steps)
    if newest - oldest > 1:
        raise DistributedError(f"the ranks' applied steps differ by more than one ({list(steps)}): they cannot all "
                               "have been cut in the same step", op="reform")
    if newest == mine + 1 and not pending:
        raise DistributedError(f"step {newest} was committed on another rank, but this rank (at step {mine}) holds no "
                               "gradient for it", op="reform")
    return newest == mine + 1


def _generators(model: Module) -> list[np.random.Generator]:
    return [m.__dict__[attr] for _, m in model.named_modules() for attr in ("_gen", "rng", "generator")
            if isinstance(m.__dict__.get(attr), np.random.Generator)]


class VirtualSteps(LiveCopies):
    """The training loop of `DistributedTrainer` on `virtual` data-parallel ranks (see the module docstring)."""

    def __init__(self, trainer: DistributedTrainer, virtual: int, seed: int, shuffle: bool,
                 deterministic: bool = True, copy_every: int | None = 1) -> None:
        if virtual < trainer.world_size:
            raise ValueError(f"virtual_ranks={virtual} is fewer than the {trainer.world_size} ranks of the group; "
                             "each rank carries at least one virtual rank")
        self.trainer = trainer
        self.virtual = virtual
        self.seed = seed
        self.shuffle = shuffle
        self.deterministic = deterministic
        self.resize(virtual)
        self.generators = _generators(trainer.module)
        self.pending = False
        """The last step's gradient is gathered and averaged, its commit not completed."""
        self.recoveries: list[Recovery] = []
        self.agreed = AgreedState(trainer, trainer.replicas) if trainer.replicas is not None else None
        """The last state the replicas agreed on (digest_every=), and the divergences left behind (`agreed`)."""
        self.transfers: list[join.StateTransfer] = []
        """The state sent to (or, first, received by) ranks that joined the running job (`axond.train.join`)."""
        self.zero = trainer.optimizer if isinstance(trainer.optimizer, VirtualZero) else None
        """ZeRO-1 (parallel="zero") or FSDP (parallel="fsdp", a subclass) on the virtual ranks, else None."""
        self.copies = BuddyCopies(self.zero, copy_every) if self.zero is not None and copy_every else None
        """The buddy copies of this rank's shards (None: off, or not ZeRO-1)."""
        self.fell_back: str | None = None
        """The checkpoint the last re-formation fell back to (both copies of a shard lost), if any."""
        env = RuntimeEnv.from_env(strict=False)
        fd = env.shard_memory_fd
        self.daemon = DaemonCopy(fd, self.zero) if self.zero is not None and fd is not None else None
        """ZeRO-1: this rank's copies in the memory its worker daemon holds (None: no worker gave any)."""
        self.relay = env.copy_relay if self.daemon is not None and env.held_memory_fd is not None else None
        """This node's worker's relay (`axond.train.relay`): where the other nodes' ranks send the buddy copies they
        keep here; buddy copies go through the workers when every rank has one."""
        self.relayed = RelayedCopies(self.daemon, env.held_memory_fd, env.copy_forward_fd, lambda: self.lineage) \
            if self.daemon is not None and env.held_memory_fd is not None and env.copy_forward_fd is not None \
            and self.copies is not None else None
        self.lineage = 0
        """Drawn when the job's training state starts, bumped on every rank when it falls back to a checkpoint: daemon
        copies of another run (or from before the fall-back) are never read."""
        self.started = False
        """ZeRO-1: the buddies and the lineage are set (`_start_copies`, or a joining rank's re-sharding)."""

    def resize(self, virtual: int) -> None:
        """Train on `virtual` virtual ranks (at construction, or a joiner adopting the running job's number)."""
        t = self.trainer
        self.virtual = virtual
        self.samplers = [DistributedSampler(len(t.dataset), virtual, v, shuffle=self.shuffle, seed=self.seed)
                         for v in range(virtual)]
        params = list(t.module.parameters())
        self.grads: VirtualGradients = (  # FSDP: reduce-scattered on virtual ranks (`axond.train.sharded`)
            ShardedGradients(params, t.optimizer, self.deterministic, t.clip_norm)
            if isinstance(t.optimizer, VirtualFSDP) else VirtualGradients(params, virtual, self.deterministic))
        self.grads.layout(t.group)
        self.totals = np.zeros((virtual, 2), np.float64)
        """Per virtual rank: (loss sum, samples) of the epoch so far, the same on every rank."""

    def join_running(self) -> bool:
        """At the start of `fit`: whether this rank joined a running live job and took its state from live peers (then
        nothing is resumed from storage)."""
        moved = join.join_running(self) if join.live_job() else None
        if moved is not None:
            self.transfers.append(moved)
            if self.zero is not None:  # the shards come by re-sharding, perhaps from this worker daemon's copy
                self._reshard(self.trainer.group, fresh=True)
                self.started = True
        if self.zero is not None and not self.started:
            self._start_copies()
        return moved is not None

    def steps_per_epoch(self) -> tuple[int, int]:
        t = self.trainer
        micro = math.ceil(self.samplers[0].num_samples / t.batch_size)
        return micro, math.ceil(micro / t.grad_accum_steps)

    def _seed_generators(self, v: int, step: int) -> None:
        """Virtual rank `v`'s random streams for global step `step` (Dropout's), whoever carries it."""
        for g in self.generators:
            g.bit_generator.state = type(g.bit_generator)(np.random.SeedSequence([self.seed, v, step])).state

    def _compute(self, indices: list[np.ndarray], step: int, micro: int) -> int:
        """Run this rank's virtual ranks' micro-batches of epoch step `step`, each into its row; returns samples."""
        t = self.trainer
        first = step * t.grad_accum_steps
        count = min(t.grad_accum_steps, micro - first)
        used = 0
        for row, v in enumerate(self.grads.mine):
            t.module.zero_grad()
            self._seed_generators(v, t.position.global_step)
            loss_sum, samples = 0.0, 0
            for m in range(count):
                rows = indices[v][(first + m) * t.batch_size : (first + m + 1) * t.batch_size]
                x, y = t.dataset.batch(rows)
                loss = float(t.loss_fn(t.module(x), y))
                grad = t.loss_fn.backward()
                t.module.backward(grad / count if count > 1 else grad)
                loss_sum += loss * len(rows)
                samples += len(rows)
            self.grads.capture(row, loss_sum, samples)
            used += samples
        return used

    def _apply(self, publish: bool = True) -> None:
        """Apply the gathered step: clip, optimizer step, losses, position; under ZeRO-1 then all-gather the updated
        shards and post the buddy copies (`publish`; a step rolled forward in a re-formation is re-sharded instead)."""
        t = self.trainer
        self.grads.apply()
        if t.clip_norm is not None:
            t._clip(t.clip_norm)
        if self.daemon is not None:
            self.daemon.settle()  # the last daemon copy is read from the arrays this step changes
        if self.copies is not None:
            self.copies.before_step()
        t.optimizer.step()
        self.totals += self.grads.losses
        self.pending = False
        t.position.step += 1
        t.position.global_step += 1
        if self.zero is None:
            return
        if self.copies is not None:
            self.copies.after_step()
        if publish:
            due = self.copies is None or self.copies.due()  # the daemon copy as often as the buddy's (sent from it)
            if self.daemon is not None and due:
                self.daemon.post(self.lineage)  # this rank's block is final: copied while the blocks are gathered
            self.zero.publish()
            if self.copies is not None and due:
                self.copies.post()

    def _step(self, indices: list[np.ndarray], micro: int) -> int:
        t = self.trainer
        self.pending = False
        grown = moved_on(t.group)  # a node joined (or left): every rank leaves this generation before the step
        if grown is not None:
            raise grown
        used = self._compute(indices, t.position.step, micro)
        if self.copies is not None:
            self.copies.settle()  # the last copies arrived: the gather below never starts with a copy in flight
        self.grads.gather()
        self.pending = True
        t.group.barrier()  # the commit: completed on one rank means every rank holds this step's gradient
        self._apply()
        return used

    def _recover(self, error: MembershipChanged) -> None:
        """Take the new generation, agree on the last committed step, roll forward if this rank is one behind."""
        t = self.trainer
        step, before, error_at, span = t.position.global_step, t.world_size, time.monotonic(), time.perf_counter_ns()
        if self.copies is not None:
            self.copies.cut()
        if self.daemon is not None:
            self.daemon.settle()
        for _ in range(MAX_REFORMS_PER_STEP):
            group = reform()
            t.group, t.comm = group, ObjectCollectives(group)
            t.rank, t.world_size, t.data_replicas = group.rank, group.size, group.size
            join.check_fits(group.size, self.virtual)
            self.grads.layout(group)
            try:  # agree on the last committed step; ranks that joined get the state (`axond.train.join`)
                settled = join.settle(self, group, fresh=False, roll_forward=roll_forward)
            except MembershipChanged as again:
                error = again
                continue
            forward = settled.rolled_forward
            if settled.transfer is not None:
                self.transfers.append(settled.transfer)
            try:
                copied, replayed, daemon = self._reshard(group)
            except MembershipChanged as again:
                error = again
                continue
            if timeline.TRACER is not None:  # from the cut collective's error to the agreed step
                timeline.TRACER.since("live.reform", "live", span, step=step, world_before=before,
                                      world_after=group.size, generation=error.generation, reason=error.reason,
                                      rolled_forward=forward, from_copies=copied, replayed=replayed,
                                      from_daemon=daemon, checkpoint=self.fell_back)
            self.recoveries.append(Recovery(step, before, group.size, error.generation, error.reason, error_at,
                                            time.monotonic(), forward, tuple(copied), tuple(replayed), self.fell_back,
                                            tuple(daemon)))
            return
        raise error

    def run_epochs(self, epochs: int, progress: Progress) -> bool:
        """Train from the trainer's position to the end of `epochs`; False when a re-formation fell back to a checkpoint
        (both copies of a ZeRO-1 shard lost), from whose position the trainer starts the loop again."""
        t = self.trainer
        pos = t.position
        micro, steps = self.steps_per_epoch()
        self.fell_back = None
        if self.agreed is not None and self.agreed.step is None:
            self._agree()  # the replicas start alike (the wrapper broadcast them): the first agreed state
        if self.zero is not None:
            self.zero.tag = pos.global_step
            if self.daemon is not None and self.daemon.written != pos.global_step:
                self.daemon.post(self.lineage)  # first: a relayed buddy copy is sent from it
            if self.copies is not None and self.copies.sent != pos.global_step:
                self.copies.post()
        while pos.epoch < epochs:
            for sampler in self.samplers:
                sampler.set_epoch(pos.epoch)
            indices = [s.indices() for s in self.samplers]
            if pos.step == 0:
                self.totals[:] = 0.0
            progress.start(pos.epoch + 1, steps, pos.step)
            start, seen = time.perf_counter(), 0
            while pos.step < steps:
                began, before = time.perf_counter_ns(), pos.global_step
                try:
                    seen += self._step(indices, micro)
                except MembershipChanged as e:
                    self._recover(e)  # the cut step is run again (or was rolled forward)
                    if self.fell_back is not None:
                        return False  # from the checkpoint's position: the trainer starts the loop again
                    if pos.global_step == before:
                        continue
                mark_step()
                if timeline.TRACER is not None:
                    timeline.TRACER.since("train.step", "train", began, step=pos.global_step, world=t.world_size,
                                          virtual=list(self.grads.mine))
                loss = self.loss()
                progress.update(pos.step, loss, seen * self.virtual / max(time.perf_counter() - start, 1e-9))
                t._call("on_step_end", {"epoch": pos.epoch + 1, "step": pos.step, "global_step": pos.global_step,
                                        "loss": loss})
                if t.checkpoint_every and pos.global_step % t.checkpoint_every == 0:
                    try:
                        t.save_checkpoint()
                    except MembershipChanged as e:
                        self._recover(e)  # this checkpoint is left incomplete (never loaded); the next one is saved
                        if self.fell_back is not None:
                            return False
                if self.agreed is not None and self.agreed.due(pos.global_step) and self._agree():
                    break  # back at the agreed state (perhaps in an earlier epoch): its data order again
            progress.close()
            if pos.step < steps:
                continue
            self._end_epoch(epochs, seen / max(time.perf_counter() - start, 1e-9))
        while self.copies is not None and self.copies.works:
            try:
                self.copies.settle()
            except MembershipChanged as e:
                self._recover(e)
                if self.fell_back is not None:
                    return False
        self._admit_at_end()
        if self.daemon is not None:
            self.daemon.settle()
        return True

    def _agree(self) -> bool:
        """The replica check of a live job (`agreed`); True when this rank went back to the last agreed state. A
        re-formation while checking (the node of the diverged rank leaving) runs the check again in the new group."""
        assert self.agreed is not None
        for _ in range(MAX_REFORMS_PER_STEP):
            try:
                return self.agreed.check(self.totals)
            except MembershipChanged as e:
                self._recover(e)
        return self.agreed.check(self.totals)

    def _admit_at_end(self) -> None:
        """A node that joined during the last step is admitted before the loop returns (it receives the final state),
        rather than left waiting for ranks that are gone."""
        while (grown := moved_on(self.trainer.group)) is not None:
            self._recover(grown)

    def loss(self) -> float:
        """The epoch's mean loss so far over every virtual rank (summed in virtual-rank order: the same everywhere)."""
        total = np.zeros(2, np.float64)
        for v in range(self.virtual):
            total += self.totals[v]
        return float(total[0] / max(total[1], 1.0))

    def _end_epoch(self, epochs: int, rate: float) -> None:
        t = self.trainer
        pos = t.position
        metrics: dict[str, Any] = {"epoch": pos.epoch + 1, "loss": self.loss()}
        t._call("on_epoch_end", metrics)
        metrics["samples_per_s"] = rate
        pos.history.append(metrics)
        if t.rank == 0 and t.progress_enabled:
            print(f"epoch {pos.epoch + 1}/{epochs} loss {metrics['loss']:.4f} samples/s {rate:.0f}", flush=True)
        pos.epoch += 1
        pos.step = 0
        self.totals[:] = 0.0
