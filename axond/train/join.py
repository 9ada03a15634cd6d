"""Joining back: ranks that start in a running live job take the training state from a live peer.

When a node joins a live job (`axond worker --live-recovery --nnodes MIN:MAX` below MAX), the coordinator opens the
next generation with the running ranks and the new ones. The running ranks re-form in their processes
(`axond.reform()`, after `MembershipChanged` at a step boundary); the new ones start, build their trainer and call
`fit`. Both then run the same few collectives here, in the new generation's group:

1. one all_gather of (applied steps, holds an uncommitted gradient, fresh, virtual ranks) per rank: fresh ranks are
   the new ones (when every rank is new, they all take the largest number of virtual ranks);
2. the running ranks agree on the last committed step among themselves (`roll_forward`);
3. if any rank is fresh (and any is not), the lowest running rank broadcasts the state: first a small JSON manifest
   (position, virtual ranks, the optimizer's hyper-parameters and scalars, the names, shapes and dtypes of the
   arrays), then every array in place, straight from the source's parameters and optimizer state (zero-copy; the
   receivers' parameters are filled in place, their optimizer state allocated once from the manifest). Under ZeRO-1
   only the position goes this way (`transfer_position`): every rank then re-shards (`axond.train.reassemble`), each
   virtual shard's parameters and state going from the running rank that carried it (or a daemon copy) to its
   carrier in the new world.

The random streams need no transfer: the virtual-rank loop seeds each virtual rank's generators from the trainer's
seed, the virtual rank and the global step. Nothing is read from storage.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from axond.checkpoint.api import ObjectCollectives
from axond.distributed import membership
from axond.distributed.process_group import ProcessGroup
from axond.distributed.reform import reform
from axond.errors import DistributedError, MembershipChanged
from axond.observe import timeline
from axond.train.resume import Position

if TYPE_CHECKING:
    from axond.train.live import VirtualSteps

_SCALARS = (bool, int, float, str, type(None))
COALESCE_BELOW = 1 << 20
"""Arrays smaller than this (bytes) travel packed together; larger ones are broadcast from their own memory."""


@dataclass(frozen=True)
class StateTransfer:
    """One transfer of the training state to ranks that joined a running job (recorded on every rank)."""

    step: int
    """The global step the state is at (the joiners' first step is the next)."""
    source: int
    """The group rank that sent it."""
    joined: tuple[int, ...]
    """The group ranks that received it (they started in this generation)."""
    world: int
    nbytes: int
    """Bytes of the arrays broadcast (the manifest not counted)."""
    seconds: float
    """From the start of the manifest's broadcast to the last array's, on this rank."""
    received: bool
    """This rank was one of the joiners."""


@dataclass(frozen=True)
class Settled:
    """What the ranks of a new generation agreed on."""

    rolled_forward: bool
    transfer: StateTransfer | None


def check_fits(world: int, virtual: int) -> None:
    """Raise a clear `DistributedError` when a generation has more ranks than the job's virtual ranks."""
    if world > virtual:
        raise DistributedError(
            f"the job grew to {world} ranks but trains {virtual} virtual ranks (each rank carries at least one): "
            f"pass DistributedTrainer(virtual_ranks=...) at least the job's largest world size (--nnodes MAX x "
            "--nproc-per-node) when it starts below MAX", op="join")


RollForward = Callable[[Sequence[int], int, bool], bool]
"""`axond.train.live.roll_forward(steps, mine, pending)`: whether this running rank applies the cut step now."""


def settle(steps: VirtualSteps, group: ProcessGroup, fresh: bool, roll_forward: RollForward | None = None) -> Settled:
    """Steps 1-3 of the module docstring for this rank (`fresh`: it started in this generation; a running rank passes
    `roll_forward`). Collective."""
    t = steps.trainer
    mine = np.array([t.position.global_step, int(steps.pending), int(fresh), steps.virtual], np.int64)
    agreed = group.all_gather(mine)
    running = [r for r in range(group.size) if not agreed[r, 2]]
    most = int(agreed[:, 3].max())
    if not running and most != steps.virtual:  # every rank new: their defaults differ (nodes of unlike sizes)
        steps.resize(most)
    forward = False
    if not fresh and running and roll_forward is not None:
        forward = roll_forward([int(agreed[r, 0]) for r in running], t.position.global_step, steps.pending)
        if forward:
            steps._apply(publish=False)  # ZeRO-1: the re-formation re-shards (`VirtualSteps._reshard`)
    steps.pending = False
    if not running or len(running) == group.size:
        return Settled(forward, None)
    joined = tuple(r for r in range(group.size) if agreed[r, 2])
    if steps.zero is not None:  # ZeRO-1: the position here, the shards re-sharded next (`VirtualSteps._reshard`)
        moved = transfer_position(steps, group, running[0], joined)
    else:
        moved = transfer(steps, group, running[0], joined)
    if steps.agreed is not None:  # digest_every in a live job: every rank now holds this state, checked and kept
        steps.agreed.check(steps.totals)
    return Settled(forward, moved)


def transfer(steps: VirtualSteps, group: ProcessGroup, source: int, joined: Sequence[int]) -> StateTransfer:
    """Broadcast the training state from group rank `source` to every rank (collective; see the module docstring)."""
    t = steps.trainer
    began, span = time.perf_counter(), time.perf_counter_ns()
    sending = group.rank == source
    model = t.module.state_dict()
    optim = t.optimizer.state_dict()
    manifest = share_manifest(group, source, _manifest(steps, model, optim) if sending else None)
    targets = _targets(manifest, model, optim, t.optimizer.params) if not sending else None
    arrays = [(model[name] if kind == "model" else optim["state"][name]) if targets is None else targets[i]
              for i, (kind, name, _, _) in enumerate(manifest["arrays"])]
    nbytes = broadcast_arrays(group, arrays, source)
    if group.rank in joined:  # a running rank that is not the source received its own state again: nothing to adopt
        _adopt(steps, manifest, targets or [])
    seconds = time.perf_counter() - began
    record = StateTransfer(int(manifest["position"]["global_step"]), source, tuple(joined), group.size, nbytes,
                           seconds, group.rank in joined)
    if timeline.TRACER is not None:
        timeline.TRACER.since("live.join", "live", span, step=record.step, source=source, joined=list(joined),
                              nbytes=nbytes, received=record.received)
    return record


def share_manifest(group: ProcessGroup, source: int, manifest: dict[str, Any] | None) -> dict[str, Any]:
    """Broadcast a JSON manifest from `source` (which passes it; the others pass None) and return it everywhere."""
    text = json.dumps(manifest).encode() if group.rank == source else b""
    size = np.array([len(text)], np.int64)
    group.broadcast(size, source)
    raw = np.frombuffer(text, np.uint8).copy() if group.rank == source else np.empty(int(size[0]), np.uint8)
    group.broadcast(raw, source)
    shared: dict[str, Any] = json.loads(raw.tobytes())
    return shared


def transfer_position(steps: VirtualSteps, group: ProcessGroup, source: int, joined: Sequence[int]) -> StateTransfer:
    """ZeRO-1: broadcast the position, losses, hyper-parameters and daemon-copy lineage from `source`; the parameters
    and the optimizer state's shards follow by re-sharding (`axond.train.reassemble`), not from one rank
    (collective)."""
    t = steps.trainer
    began = time.perf_counter()
    sending = group.rank == source
    optim = {"defaults": t.optimizer.defaults, "state": {}}
    shared = {**_manifest(steps, {}, optim), "lineage": steps.lineage} if sending else None
    manifest = share_manifest(group, source, shared)
    if group.rank in joined:
        if int(manifest["virtual"]) != steps.virtual:
            raise DistributedError(f"the running ranks train ZeRO-1 on {manifest['virtual']} virtual ranks, this rank "
                                   f"on {steps.virtual}: its shards cannot be re-sharded; leave "
                                   "DistributedTrainer(virtual_ranks=...) at its default, or pass every rank the same",
                                   op="join", group=group.name, rank=group.rank)
        _adopt(steps, manifest, [], optimizer_state=False)
        steps.lineage = int(manifest["lineage"])
    return StateTransfer(int(manifest["position"]["global_step"]), source, tuple(joined), group.size, 0,
                         time.perf_counter() - began, group.rank in joined)


def broadcast_arrays(group: ProcessGroup, arrays: Sequence[np.ndarray], source: int) -> int:
    """Broadcast `arrays` in place from `source`: each one of COALESCE_BELOW bytes or more straight from its memory
    (zero-copy), the smaller ones packed into one message per dtype (one round trip instead of one each). Returns the
    bytes sent."""
    small: dict[np.dtype[Any], list[np.ndarray]] = {}
    nbytes = 0
    for array in arrays:
        if array.nbytes >= COALESCE_BELOW:
            group.broadcast(array, source)
        elif array.size:
            small.setdefault(array.dtype, []).append(array)
        nbytes += array.nbytes
    for dtype, members in small.items():
        flat = np.empty(sum(a.size for a in members), dtype)
        offsets = np.cumsum([0] + [a.size for a in members]).tolist()
        if group.rank == source:
            for a, lo, hi in zip(members, offsets, offsets[1:]):
                flat[lo:hi] = a.reshape(-1)
        group.broadcast(flat, source)
        if group.rank != source:
            for a, lo, hi in zip(members, offsets, offsets[1:]):
                a.reshape(-1)[...] = flat[lo:hi]
    return nbytes


def _manifest(steps: VirtualSteps, model: dict[str, Any], optim: dict[str, Any]) -> dict[str, Any]:
    t = steps.trainer
    arrays = [("model", k, list(v.shape), str(v.dtype)) for k, v in model.items()]
    arrays += [("optim", k, list(v.shape), str(v.dtype)) for k, v in optim["state"].items() if hasattr(v, "shape")]
    scalars = {k: v for k, v in optim["state"].items() if not hasattr(v, "shape")}
    for key, value in scalars.items():
        if not isinstance(value, _SCALARS):
            raise DistributedError(f"optimizer state {key!r} is a {type(value).__name__}, neither an array nor a "
                                   "scalar: it cannot be sent to a joining rank", op="join")
    defaults = {k: (list(v) if isinstance(v, tuple) else v) for k, v in optim["defaults"].items()
                if isinstance(v, _SCALARS) or (isinstance(v, tuple) and all(isinstance(x, _SCALARS) for x in v))}
    return {"position": t.position.to_state(), "virtual": steps.virtual, "totals": steps.totals.tolist(),
            "defaults": defaults, "tuples": [k for k, v in optim["defaults"].items() if isinstance(v, tuple)],
            "scalars": scalars, "arrays": arrays}


def _dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _targets(manifest: dict[str, Any], model: dict[str, Any], optim: dict[str, Any],
             params: Sequence[Any]) -> list[np.ndarray]:
    """Where each array of the manifest lands on a receiver: its own parameter (in place), its optimizer state array
    if it has the right shape, else a new array (allocated once per join)."""
    out = []
    for kind, name, shape, dtype in manifest["arrays"]:
        want, dt = tuple(shape), _dtype(dtype)
        mine = model.get(name) if kind == "model" else optim["state"].get(name)
        if kind == "model" and (mine is None or mine.shape != want or mine.dtype != dt):
            raise DistributedError(f"the running ranks' model has {name!r} of shape {want} and dtype {dtype}, this "
                                   f"rank's has {getattr(mine, 'shape', None)}: every rank must build the same model",
                                   op="join")
        if kind == "optim" and int(name.split(".", 1)[0]) >= len(params):
            raise DistributedError(f"the running ranks' optimizer state names parameter {name}, this rank's optimizer "
                                   f"has {len(params)} parameters", op="join")
        if mine is not None and isinstance(mine, np.ndarray) and mine.shape == want and mine.dtype == dt \
                and mine.flags.c_contiguous:
            out.append(mine)
        else:
            out.append(np.empty(want, dt))
    return out


def _adopt(steps: VirtualSteps, manifest: dict[str, Any], targets: list[np.ndarray],
           optimizer_state: bool = True) -> None:
    """Make the received state this rank's: the optimizer's state (`optimizer_state`) and hyper-parameters, the
    position, the losses."""
    t = steps.trainer
    if int(manifest["virtual"]) != steps.virtual:
        steps.resize(int(manifest["virtual"]))
    defaults = {k: (tuple(v) if k in manifest["tuples"] else v) for k, v in manifest["defaults"].items()}
    opt = t.optimizer
    opt.defaults.update(defaults)
    if optimizer_state:
        state: dict[str, Any] = dict(manifest["scalars"])
        state.update({name: targets[i] for i, (kind, name, _, _) in enumerate(manifest["arrays"]) if kind == "optim"})
        opt.state = [{} for _ in opt.params]
        for key, value in state.items():
            index, name = key.split(".", 1)
            opt.state[int(index)][name] = value
    got = Position.from_objects({f"trainer/{k}": v for k, v in manifest["position"].items()})
    pos = t.position  # in place: the loop holds this object
    pos.epoch, pos.step, pos.global_step, pos.history = got.epoch, got.step, got.global_step, got.history
    steps.totals[:] = np.asarray(manifest["totals"], np.float64)


def join_running(steps: VirtualSteps) -> StateTransfer | None:
    """At the start of `fit` in a live job: take part in step 1-3 as a fresh rank (the running ranks do the same after
    their re-formation); the transfer when this rank joined a running job, None when every rank is new (the job's
    first generation, or a restart: `fit` then resumes from storage as usual)."""
    t = steps.trainer
    for _ in range(8):
        try:
            return settle(steps, t.group, fresh=True).transfer
        except MembershipChanged:  # a running rank was lost while this one joined: take the next generation too
            group = reform()
            t.group, t.comm = group, ObjectCollectives(group)
            t.rank, t.world_size, t.data_replicas = group.rank, group.size, group.size
            check_fits(group.size, steps.virtual)
            steps.grads.layout(group)
    raise DistributedError("joining a running job: the group re-formed 8 times before the state arrived", op="join")


def live_job() -> bool:
    """Whether this process runs in a live job (`axond worker --live-recovery`)."""
    return membership.current() is not None
