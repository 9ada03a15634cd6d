"""The watchdog of an NCCL communicator: aborts it when an op hangs, so that no call waits forever.

GPU-free: an op is watched through its completion `event` (anything with a `done` attribute: a CUDA event in
`backend.py`) or a `done()` callable, and the abort is a callable (`NcclCommunicator.abort`), so CI tests the
timing logic with real threads. The ops in flight are a dict in launch order: adding and removing one is O(1)
under a short lock, and `reap` retires the oldest completed ones without waiting for the thread's tick.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from axond.errors import DistributedError


@dataclass(eq=False)
class WatchedOp:
    """An op in flight on the communicator, with the deadline after which the watchdog aborts it."""

    op: str
    peer: int | None
    deadline: float
    done: Callable[[], bool] | None = None
    """True once the op completed; may raise if the device failed. None: `recorded` and `event.done` say it."""
    keep: tuple[Any, ...] = ()
    """Device buffers the op reads or writes, held until it completes so the memory pool cannot reuse them."""
    aborted: bool = False
    """Set when the communicator was aborted with this op in flight: its result is void."""
    started: float = field(default_factory=time.monotonic)
    event: Any = None
    """The completion event (its `done` attribute queries it), once `recorded` is set."""
    recorded: bool = False
    """Set after the completion event was recorded behind the op (an unrecorded CUDA event reads as done)."""
    completed: bool = False
    """Set once the op was seen complete: nothing queries `event` again (it may be reused)."""

    def is_done(self) -> bool:
        """Whether the op completed (may raise if the device failed)."""
        if self.completed:
            return True
        if self.done is not None:
            return bool(self.done())
        return self.recorded and bool(self.event.done)


class Watchdog:
    """One thread per communicator: aborts it when an op outlives its deadline or NCCL reports an error.

    After the abort the communicator is dead: `failure` holds the `DistributedError` that every waiter
    and every later op raises. The thread polls every `tick` seconds, so a hang ends within about
    timeout + tick. Ops in flight at the abort are marked `aborted`: their events may fire because the
    abort killed the kernels, and that must not read as success.
    """

    def __init__(
        self,
        *,
        group: str,
        rank: int,
        abort: Callable[[], None],
        async_error: Callable[[], str | None] | None = None,
        tick: float = 0.05,
        abort_grace: float = 60.0,
        on_done: Callable[[WatchedOp], None] | None = None,
    ) -> None:
        """`on_done(op)` runs once per op seen complete (the backend returns its event to the pool)."""
        self.group = group
        self.rank = rank
        self._abort = abort
        self._async_error = async_error
        self.explain: Callable[[WatchedOp], str] | None = None
        """Says what the peers are doing when `op` timed out (their in-flight reports), appended to the error."""
        self._tick = tick
        self._abort_grace = abort_grace
        self._on_done = on_done
        self._ops: dict[int, WatchedOp] = {}
        self._lock = threading.Lock()
        self._aborting = False
        self._failure: DistributedError | None = None
        self._failed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"axond-nccl-watchdog[{group}:{rank}]", daemon=True)
        self._thread.start()

    @property
    def failure(self) -> DistributedError | None:
        """The error that aborted the communicator, or None while it is healthy."""
        return self._failure

    def watch(self, op: WatchedOp) -> None:
        """Start watching `op`; raises the recorded failure if the communicator is aborted."""
        with self._lock:
            aborting = self._aborting
            if not aborting:
                self._ops[id(op)] = op
        if aborting:
            self._failed.wait(self._abort_grace)
            raise self._reraise(op.op)

    def finished(self, op: WatchedOp, completed: bool = True) -> None:
        """Stop watching `op`: it completed (`on_done` runs once), or its launch failed (`completed=False`)."""
        with self._lock:
            mine = self._ops.pop(id(op), None) is op
        if mine and completed and not op.aborted:
            op.completed = True
            op.keep = ()
            if self._on_done is not None:
                self._on_done(op)

    def reap(self, limit: int = 4) -> int:
        """Retire up to `limit` of the oldest ops in flight that completed (ops on one stream complete in launch
        order, so it stops at the first one still running); returns how many. Never blocks."""
        retired = 0
        while retired < limit:
            with self._lock:
                oldest = next(iter(self._ops.values()), None)
            if oldest is None:
                break
            try:
                if not oldest.is_done():
                    break
            except Exception:  # noqa: BLE001 - the thread's scan reports the device's failure
                break
            self.finished(oldest)
            retired += 1
        return retired

    def in_flight(self) -> int:
        """How many ops are watched now."""
        return len(self._ops)

    def wait(self, op: WatchedOp, timeout: float | None = None) -> bool:
        """Block until `op` is done (True); raise `DistributedError` if it was aborted.

        With `timeout`, return False if the op is still running then (it stays watched); without one,
        the op's deadline bounds the wait.
        """
        give_up = None if timeout is None else time.monotonic() + timeout
        delay = 1e-5
        while True:
            if op.aborted:
                self._failed.wait(self._abort_grace)
                raise self._reraise(op.op)
            try:
                if op.is_done() and not op.aborted:
                    return True
            except Exception as e:  # noqa: BLE001 - the device's failure fails the op, naming it
                self.fail(op, f"the device reported {type(e).__name__}: {e}")
                continue
            now = time.monotonic()
            if now >= op.deadline + 2 * self._tick:
                self._timed_out(op, now)
                continue
            if give_up is not None and now >= give_up:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _timed_out(self, op: WatchedOp, now: float) -> None:
        """Fail `op` for outliving its deadline, saying what the peers are doing when `explain` can tell."""
        why = f"it did not complete within {now - op.started:.1f}s"
        if self.explain is not None and not self._aborting:
            try:
                why += f" ({self.explain(op)})"
            except Exception as e:  # noqa: BLE001 - the explanation is a hint; the timeout is the error
                why += f" (the peers could not be asked what they do: {type(e).__name__})"
        self.fail(op, why)

    def fail(self, op: WatchedOp, why: str) -> None:
        """Record the failure of `op`, mark every op in flight aborted and abort the communicator (once)."""
        peer = "" if op.peer is None else f" (peer {op.peer})"
        message = (
            f"nccl {op.op}: group {self.group!r} rank {self.rank}{peer}: {why}; the communicator was aborted "
            "(ncclCommAbort); a peer may have died or called a different collective. Re-create the group"
        )
        with self._lock:
            op.aborted = True
            if self._aborting:
                return
            self._aborting = True
            for other in self._ops.values():
                other.aborted = True
            self._ops.clear()
        try:
            self._abort()
        except Exception as e:  # noqa: BLE001 - the abort's own failure is added to the message
            message += f" (ncclCommAbort itself failed: {type(e).__name__}: {e})"
        self._failure = DistributedError(message, op=op.op, group=self.group, rank=self.rank, peer=op.peer)
        self._failed.set()

    def wait_failure(self, op: str) -> DistributedError:
        """The error to raise for `op` once `fail` was called (waits, bounded, for the abort to finish)."""
        self._failed.wait(self._abort_grace)
        return self._reraise(op)

    def close(self) -> None:
        """Stop the thread (bounded join); idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 10 * self._tick))

    def _reraise(self, op: str) -> DistributedError:
        failure = self._failure
        if failure is None:
            return DistributedError(
                f"nccl {op}: group {self.group!r} rank {self.rank}: the communicator is being aborted and "
                f"ncclCommAbort did not return within {self._abort_grace:.0f}s",
                op=op, group=self.group, rank=self.rank,
            )
        if failure.op == op:
            return failure
        return DistributedError(
            f"nccl {op}: group {self.group!r} rank {self.rank}: the communicator is aborted: {failure}",
            op=op, group=self.group, rank=self.rank, peer=failure.peer,
        )

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            self._scan()

    def _scan(self) -> None:
        with self._lock:
            if self._aborting:
                return
            ops = list(self._ops.values())
        now = time.monotonic()
        for op in ops:
            try:
                finished = op.is_done()
            except Exception as e:  # noqa: BLE001 - the device's failure fails the op, naming it
                self.fail(op, f"the device reported {type(e).__name__}: {e}")
                return
            if finished:
                self.finished(op)
            elif now >= op.deadline:
                self._timed_out(op, now)
                return
        if self._async_error is not None and ops:
            error = self._async_error()
            if error is not None:
                self.fail(ops[0], f"NCCL reported an asynchronous error: {error}")
