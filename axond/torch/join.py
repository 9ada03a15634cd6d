"""Joining a running torch live job: ranks that start in a later generation take the state from a live peer.

When a node joins a running live job (a failed node's worker starting its rank again with restarts left, or a new
`axond worker` below `--nnodes` MAX), the coordinator opens the next generation with the running ranks and the new
ones. The running ranks' next collective is cut (`axond.distributed.live_watch`), their `Manager` re-forms torch's
default group (`axond.torch.reform`); the new ones form it with `init_process_group("axond")` in the same
generation's store and build their `Manager`. Both then run the same collectives, in the native trainer's order
(`axond.train.join`):

1. one all_gather of (committed steps, holds an uncommitted step's gradient, fresh, virtual ranks) per rank: fresh
   ranks are the new ones (when every rank is new, this is the job's first generation or a restart: nothing moves);
2. the running ranks agree on the last committed step among themselves (`axond.train.live.roll_forward`);
3. if any rank is fresh, the lowest running rank broadcasts the manager's state over the "axond" data plane: a JSON
   manifest of its structure (the committed steps, the optimizer's hyper-parameters and scalars, each tensor's path,
   shape and dtype), then every tensor's bytes in place (`axond.train.join`'s coalescing broadcast: a large tensor
   straight from its memory, the small ones packed). The receivers' parameters are filled in place; their optimizer
   state is allocated once from the manifest. No storage, no pickle.

The data position is the committed step count (`Manager.batch_indices` and the seeds are functions of it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from axond.distributed.process_group import ProcessGroup
from axond.errors import DistributedError
from axond.observe import timeline
from axond.torch.process_group import AxondProcessGroup
from axond.train.join import StateTransfer, broadcast_arrays, share_manifest
from axond.train.live import roll_forward

if TYPE_CHECKING:
    from axond.torch.live import Manager

__all__ = ["StateTransfer", "broadcast_state", "check_live_store", "rows", "settle"]

_SCALARS = (bool, int, float, str, type(None))


def axond_group() -> ProcessGroup:
    """The axond group under torch's default group (the "axond" backend's)."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    if not isinstance(backend, AxondProcessGroup):
        raise DistributedError(f"a live torch job needs torch's default group over the \"axond\" backend, not "
                               f"{type(backend).__name__}: init_process_group(\"axond\")", op="join")
    return backend.axond_group


def check_live_store() -> None:
    """Raise when torch's default group of a live job met in torch's TCPStore (MASTER_ADDR) instead of the
    generation's store, where re-formed ranks and joining ones meet (`axond.torch.rendezvous.live_store`)."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        raise DistributedError("torch's default group of this live job was formed over torch's TCPStore (MASTER_ADDR), "
                               "where ranks that join it later cannot meet it: import axond.torch (or "
                               "axond.torch.live) before init_process_group(\"axond\")", op="live manager")


def rows(manager: Manager, fresh: bool) -> list[list[int]]:
    """Step 1 of the module docstring: every rank's (committed steps, holds an uncommitted step's gradient, fresh,
    virtual ranks, newest and oldest copy of the state it keeps or -1: `ShardedManager`'s). Collective."""
    newest, oldest = manager._copy_tags()
    mine = torch.tensor([manager._committed, int(manager._pending), int(fresh), manager.virtual, newest, oldest],
                        dtype=torch.int64)
    every = [torch.zeros(6, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.stack(every).tolist()


def settle(manager: Manager, fresh: bool) -> tuple[bool, StateTransfer | None]:
    """Steps 1-3 of the module docstring for this rank (`fresh`: it started in this generation): whether it applied
    the cut step (a running rank whose commit was cut while another's completed), and the transfer, if any.
    Collective over torch's default group."""
    agreed = rows(manager, fresh)
    world = len(agreed)
    running = [r for r in range(world) if not agreed[r][2]]
    if not running:  # every rank new: the job's first generation, or a restart
        manager._resize(max(row[3] for row in agreed))
        return False, None
    rolled = False
    if not fresh:
        rolled = roll_forward([agreed[r][0] for r in running], manager._committed, manager._pending)
        if rolled:
            manager.apply_step()
            manager._committed += 1
            manager.loss = None
    manager._pending = False
    if len(running) == world:
        return rolled, None
    joined = tuple(r for r in range(world) if agreed[r][2])
    manager._resize(agreed[running[0]][3])
    return rolled, transfer(manager, running[0], joined)


def transfer(manager: Manager, source: int, joined: Sequence[int], state: dict[str, Any] | None = None
             ) -> StateTransfer:
    """Broadcast the manager's state (`state`, default `manager.state_dict()`) from group rank `source` to the ranks in
    `joined` (every rank calls it); a joining rank takes it (`manager._take`). A receiver fills the tensors of its
    `state` (default `manager._receive_into()`) in place where they are alike."""
    group = axond_group()
    began, span = time.perf_counter(), time.perf_counter_ns()
    sending = group.rank == source
    if state is None:
        state = manager.state_dict() if sending else manager._receive_into()
    state, nbytes = broadcast_state(group, source, state if sending else None, None if sending else state)
    if group.rank in joined:
        manager._take(state)
    seconds = time.perf_counter() - began
    record = StateTransfer(int(state["step"]), source, tuple(joined), group.size, nbytes, seconds, group.rank in joined)
    if timeline.TRACER is not None:
        timeline.TRACER.since("live.join", "live", span, step=record.step, source=source, joined=list(joined),
                              nbytes=nbytes, received=record.received)
    return record


def broadcast_state(group: ProcessGroup, source: int, state: Any | None, into: Any | None) -> tuple[Any, int]:
    """`state` (a tree of dicts, lists and tuples of tensors and JSON scalars, passed on `source`) on every rank, and
    the bytes of its tensors. A receiver fills the tensors of `into` at the same paths in place where their shape and
    dtype match (its parameters), and allocates the others once. Collective."""
    sending = group.rank == source
    tensors: list[torch.Tensor] = []
    manifest = share_manifest(group, source, {"tree": _skeleton(state, "", tensors)} if sending else None)
    if not sending:
        mine: dict[str, torch.Tensor] = {}
        _paths(into, "", mine)
        tensors = [_target(entry, mine.get(entry["p"])) for entry in _entries(manifest["tree"])]
    arrays = [_bytes(t) for t in tensors]
    nbytes = broadcast_arrays(group, arrays, source)
    if sending:
        return state, nbytes
    return _build(manifest["tree"], tensors), nbytes


def _skeleton(value: Any, path: str, tensors: list[torch.Tensor]) -> Any:
    """`value`'s structure as JSON, each tensor replaced by its index into `tensors` (appended), path, shape, dtype."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise DistributedError(f"state {path!r} is a {value.layout} tensor: only dense tensors go to a joining "
                                   "rank", op="join")
        tensors.append(value.detach())
        return {"t": len(tensors) - 1, "p": path, "shape": list(value.shape), "dtype": str(value.dtype)[6:]}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise DistributedError(f"state {path!r} has a key {key!r} of type {type(key).__name__}: a joining "
                                       "rank takes str and int keys only", op="join")
        return {"d": [[k, _skeleton(v, f"{path}/{k}", tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"l" if isinstance(value, list) else "u": [_skeleton(v, f"{path}/{i}", tensors)
                                                          for i, v in enumerate(value)]}
    if isinstance(value, _SCALARS):
        return {"v": value}
    raise DistributedError(f"state {path!r} is a {type(value).__name__}, neither a tensor, a container nor a scalar: "
                           "it cannot be sent to a joining rank", op="join")


def _paths(value: Any, path: str, out: dict[str, torch.Tensor]) -> None:
    """Every tensor of `value` by the path `_skeleton` gives it."""
    if isinstance(value, torch.Tensor):
        out[path] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            _paths(v, f"{path}/{k}", out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _paths(v, f"{path}/{i}", out)


def _entries(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The tensor entries of a skeleton, in index order."""
    found: list[dict[str, Any]] = []

    def walk(n: dict[str, Any]) -> None:
        if "t" in n:
            found.append(n)
        elif "d" in n:
            for _, child in n["d"]:
                walk(child)
        else:
            for child in n.get("l", n.get("u", ())):
                walk(child)
    walk(node)
    return sorted(found, key=lambda e: e["t"])


def _target(entry: dict[str, Any], mine: torch.Tensor | None) -> torch.Tensor:
    """Where a received tensor lands: this rank's own at the same path (in place) if alike, else a new one."""
    dtype = getattr(torch, entry["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise DistributedError(f"state {entry['p']!r} has dtype {entry['dtype']!r}, unknown to this rank's torch "
                               f"{torch.__version__}: every rank must run the same torch", op="join")
    shape = tuple(entry["shape"])
    if mine is not None and tuple(mine.shape) == shape and mine.dtype == dtype and mine.device.type == "cpu" \
            and mine.is_contiguous():
        return mine.detach()
    return torch.empty(shape, dtype=dtype)


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a numpy array over its memory (zero-copy; a CPU copy of a device tensor on the sender)."""
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _build(node: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    if "t" in node:
        return tensors[node["t"]]
    if "d" in node:
        return {k: _build(v, tensors) for k, v in node["d"]}
    if "l" in node:
        return [_build(v, tensors) for v in node["l"]]
    if "u" in node:
        return tuple(_build(v, tensors) for v in node["u"])
    return node["v"]
