"""`monitored_barrier`: a barrier through the job's store that names the ranks that did not arrive.

As torch's (a debugging aid, not a fast path): every member posts an arrival key; group rank 0
waits for them up to the timeout, then releases the others. Ranks that did not come are named: the
first one, or all of them with `wait_all_ranks`. Each comes with what it is blocked in (see
`axond.distributed.diagnostics.inflight`), and every member raises the same `DistributedError`. Only the store
(the control plane) is used, so it also works when the data plane is what hangs. The store keeps at
most the last barrier's verdict per group: once everyone arrived at barrier k, all of them have read
verdict k-1, so rank 0 deletes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from axond.errors import DistributedError, StoreTimeout, rank_list
from axond.store import Store

PREFIX = "axond/monitored_barrier/{group}/{seq}/"
RELEASE_MARGIN = 5.0
DESCRIBED = 4
"""Missing ranks whose state a barrier's error describes (the rest are only counted)."""
"""Extra seconds the other ranks wait for rank 0's verdict beyond the timeout (it may still be asking)."""


def monitored_barrier(store: Store, group: str, rank: int, size: int, seq: int, timeout: float,
                      wait_all_ranks: bool, describe: Callable[[int], str]) -> None:
    """Barrier number `seq` of `group`, as group rank `rank` of `size`; `describe(r)` says what rank r is doing."""
    prefix = PREFIX.format(group=group, seq=seq)
    where = f"monitored_barrier on group '{group}' (rank {rank} of {size})"

    def fail(what: str, peer: int | None) -> DistributedError:
        return DistributedError(f"{where}: {what}", op="monitored_barrier", group=group, rank=rank, peer=peer)

    if rank != 0:
        store.set(f"{prefix}arrived/{rank}", b"1")
        try:
            verdict = store.get(f"{prefix}released", timeout + RELEASE_MARGIN)
        except StoreTimeout:
            raise fail(f"rank 0, which runs the barrier, did not release it within {timeout + RELEASE_MARGIN:.1f} s; "
                       f"{describe(0)}", 0) from None
        if verdict != b"ok":
            raise fail(verdict.decode(errors="replace"), None)
        return
    deadline = time.monotonic() + timeout
    missing: list[int] = []
    for r in range(1, size):
        key = f"{prefix}arrived/{r}"
        left = deadline - time.monotonic()
        try:
            if left <= 0:  # past the deadline (wait_all_ranks): only look
                if store.try_get(key) is None:
                    raise StoreTimeout(key)
            else:
                store.wait([key], left)
        except StoreTimeout:
            missing.append(r)
            if not wait_all_ranks:
                break
    if not missing:
        store.set(f"{prefix}released", b"ok")
        for r in range(1, size):
            store.delete(f"{prefix}arrived/{r}")
        if seq > 1:  # every member arrived here, so each one read the previous verdict
            store.delete(PREFIX.format(group=group, seq=seq - 1) + "released")
        return
    described = "; ".join(describe(r) for r in missing[:DESCRIBED])
    if len(missing) > DESCRIBED:
        described += f"; {len(missing) - DESCRIBED} more not described"
    who = f"ranks {rank_list(missing)}" if len(missing) > 1 else f"rank {missing[0]}"
    what = (f"{who} did not reach it within {timeout:.1f} s"
            + ("" if wait_all_ranks else " (wait_all_ranks=True names every missing rank)") + "; " + described)
    store.set(f"{prefix}released", f"rank 0 gave up: {what}".encode())
    raise fail(what, missing[0])
