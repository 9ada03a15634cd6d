"""Instrumenting a process group's collectives for metrics and the timeline (only when either is on).

`instrument(group)` replaces the group's public collectives by timed wrappers on that instance; a group
that is not instrumented runs exactly as before. Each call records op, group, bytes (of the array passed
in), the path the backend took (tcp: mailbox, single_copy, arena, two_level or sockets; otherwise the
backend's name), start and end. An async op ends when its Work completes; time the caller spends in
`Work.wait` counts as blocked.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from axond.config import RuntimeEnv
from axond.observe import timeline
from axond.observe.rank_metrics import RankMetrics

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all",
       "send", "recv", "isend", "irecv", "barrier")
"""The ProcessGroup methods that are timed."""
CHOSEN_OPS = frozenset(("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"))
"""Ops whose tcp path the backend's placement chooses; the others go over the sockets. When the choice is
skipped, the op ran in its prepared mailbox form."""

_metrics: RankMetrics | None = None
_metrics_lock = threading.Lock()


def rank_metrics(env: RuntimeEnv) -> RankMetrics | None:
    """This process's collective counters (started on first use, named after `env`'s rank, job and generation), or
    None without a metrics directory."""
    global _metrics
    if not env.observe.metrics_dir:
        return None
    with _metrics_lock:
        if _metrics is None:
            _metrics = RankMetrics(env.observe.metrics_dir, _rank_name(env), env.environ.get("AXOND_JOB", ""),
                                   env.environ.get("AXOND_GENERATION", ""))
        return _metrics


def _rank_name(env: RuntimeEnv) -> str:
    """RANK as set, else this process's id."""
    return str(env.rank) if env.rank is not None else str(os.getpid())


class _PathProbe:
    """Learns which path each op took, from the tcp backend's `placement.choose` (per thread: an async op's
    choice is made on the group's communication thread)."""

    def __init__(self, backend: Any) -> None:
        self.local = threading.local()
        placement: Any = getattr(backend, "placement", None)
        self.tcp = placement is not None and callable(getattr(placement, "choose", None))
        self.backend_name = str(getattr(backend, "name", "") or type(backend).__name__.lower())
        if self.tcp:
            choose = placement.choose

            def choose_and_note(*args: Any, **kwargs: Any) -> Any:
                path = choose(*args, **kwargs)
                self.local.path = path.kind
                return path

            placement.choose = choose_and_note

    def reset(self) -> None:
        self.local.path = None

    def taken(self, op: str) -> str:
        path = getattr(self.local, "path", None)
        self.local.path = None
        if not self.tcp:
            return self.backend_name
        if path is not None:
            return str(getattr(path, "name", path)).lower()
        return "mailbox" if op in CHOSEN_OPS else "sockets"


def _nbytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    x = args[0] if args else kwargs.get("x")
    if x is None:
        return 0
    n = getattr(x, "nbytes", None)
    if n is None and hasattr(x, "element_size") and hasattr(x, "numel"):
        n = x.element_size() * x.numel()  # a torch tensor
    return int(n or 0)


def _is_work(result: Any) -> bool:
    return callable(getattr(result, "add_done_callback", None)) and callable(getattr(result, "wait", None))


def instrument(group: Any) -> None:
    """Time `group`'s collectives (a no-op unless its environment, `group.options.env`, turns metrics or the timeline
    on, or for a non-member)."""
    env: RuntimeEnv = group.options.runtime_env()
    if not env.observe.active or getattr(group, "backend", None) is None:
        return
    wrap_group(group, rank_metrics(env), _tracer(env))


_tracer_failed = False


def _tracer(env: RuntimeEnv) -> timeline.Tracer | None:
    """The timeline's tracer, or None when it is off or its directory cannot be written (said once)."""
    global _tracer_failed
    directory = env.observe.timeline_dir
    if not directory or _tracer_failed:
        return None
    try:
        return timeline.start(directory, _rank_name(env))
    except OSError as e:
        _tracer_failed = True
        warnings.warn(f"AXOND_TIMELINE={directory}: cannot write a timeline there ({e.strerror}); "
                      "this rank runs without one", RuntimeWarning, stacklevel=2)
        return None


def wrap_group(group: Any, metrics: RankMetrics | None, tracer: timeline.Tracer | None) -> None:
    """Time `group`'s collectives into `metrics` and `tracer` (either may be None)."""
    probe = _PathProbe(group.backend)
    name = str(group.name)
    tid = tracer.tid(name) if tracer is not None else 0
    for op in OPS:
        method = getattr(group, op, None)
        if method is not None:
            setattr(group, op, _timed(op, method, name, tid, probe, metrics, tracer))


def _timed(op: str, method: Callable[..., Any], group: str, tid: int, probe: _PathProbe,
           metrics: RankMetrics | None, tracer: timeline.Tracer | None) -> Callable[..., Any]:
    clock = time.perf_counter_ns

    def finish(start: int, end: int, blocked: int, nbytes: int, path: str, error: str = "", asynchronous: bool = False
               ) -> None:
        if metrics is not None:
            metrics.record(op, group, nbytes, (end - start) / 1e9, blocked / 1e9)
        if tracer is not None:
            args: dict[str, Any] = {"group": group, "bytes": nbytes, "path": path}
            if asynchronous:
                args["async"] = True
            if error:
                args["error"] = error
            tracer.complete(op, "collective", tid, start, end, args)

    def call(*args: Any, **kwargs: Any) -> Any:
        nbytes = _nbytes(args, kwargs)
        probe.reset()
        start = clock()
        try:
            result = method(*args, **kwargs)
        except BaseException as e:
            end = clock()
            finish(start, end, end - start, nbytes, probe.taken(op), type(e).__name__)
            raise
        issued = clock()
        if not _is_work(result):
            finish(start, issued, issued - start, nbytes, probe.taken(op))
            return result
        if result.is_completed():
            finish(start, issued, issued - start, nbytes, probe.taken(op), asynchronous=True)
        else:
            result.add_done_callback(lambda work: finish(start, clock(), issued - start, nbytes, probe.taken(op),
                                                         asynchronous=True))
        _time_waits(result, op, group, metrics)
        return result

    call.__name__ = op
    call.__doc__ = method.__doc__
    return call


def _time_waits(work: Any, op: str, group: str, metrics: RankMetrics | None) -> None:
    """Count the time the caller spends in `work.wait()` as blocked (when metrics are on)."""
    if metrics is None:
        return
    wait = work.wait

    def timed_wait(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return wait(*args, **kwargs)
        finally:
            metrics.add_blocked(op, group, time.perf_counter() - start)

    try:
        work.wait = timed_wait
    except AttributeError:
        pass  # a Work type without an instance dict: its waits are not counted
