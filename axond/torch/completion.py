"""Torch `Work` objects completed by axond's async `Work`s.

Each torch op starts one or more axond async ops (run in issue order on the axond group's
communication thread) and gets a torch Future. One completion thread per group waits for the
axond Works in issue order, runs the op's copy-back, and completes the Future; torch wraps the
Future into the `Work` its wrappers wait on (`_create_work_from_future`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C._distributed_c10d import _create_work_from_future

from axond.distributed.work import Work as AxondWork

Finish = Callable[[list[Any]], Any]
"""Called with the axond Works' results once all finished; returns the Future's value."""


class Completer:
    """Completes the torch Futures of one group's ops, in issue order, on one daemon thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Sequence[AxondWork], Finish, torch.futures.Future] | None] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def launch(self, works: Sequence[AxondWork], finish: Finish) -> Any:
        """The torch Work that completes when every one of `works` did and `finish` ran."""
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"axond-torch-{self._name}", daemon=True)
                self._thread.start()
        self._queue.put((works, finish, fut))
        return _create_work_from_future(fut)

    @staticmethod
    def done(value: Any) -> Any:
        """A torch Work that is already complete (ops with nothing to send)."""
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(value)
        return _create_work_from_future(fut)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            works, finish, fut = item
            del item
            try:
                results = [w.result() for w in works]
                value = finish(results)
            except BaseException as e:
                fut.set_exception(e)
            else:
                fut.set_result(value)
            del works, finish, fut

    def close(self, timeout: float) -> None:
        """Stop once the queued ops completed (bounded by `timeout`)."""
        self._queue.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
