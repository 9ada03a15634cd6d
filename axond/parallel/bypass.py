"""`BackwardGuard`: notices a backward pass that reached a data-parallel wrapper's parameters around it.

DDP and FSDP reduce gradients inside their own `backward`. Calling the wrapped model's `backward`
instead still fills `.grad`, but with this rank's local gradients: training goes on without an error
while the replicas drift apart. The wrapper's parameter hooks report each gradient to the guard; one
arriving outside the wrapper's backward marks the guard, and the next optimizer step (through
`Parameter.register_pre_step_hook`) or wrapper forward raises `BypassedBackwardError` on every rank.
A gradient that arrives while any wrapper's backward runs in this thread is no bypass: a model wrapped
again (say, over a new group after a restart) still carries the old wrapper's hooks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

from axond.errors import BypassedBackwardError
from axond.nn.module import Parameter, RemovableHandle

_running = threading.local()
"""`depth`: how many wrapper backwards this thread is inside."""


class BackwardGuard:
    """Whether a backward bypassed wrapper `name` ("ddp" or "fsdp") since its gradients were last reduced."""

    def __init__(self, name: str, wrapper: str, consequence: str) -> None:
        self.name = name
        self.wrapper = wrapper
        """The wrapper's class name, for the message."""
        self.consequence = consequence
        """What the bypass does to training, for the message."""
        self.inside = False
        """True while the wrapper's own backward runs."""
        self.bypassed = False

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around the wrapper's call of the module's backward: gradients arriving now are expected."""
        previous, self.inside = self.inside, True
        _running.depth = getattr(_running, "depth", 0) + 1
        try:
            yield
        finally:
            self.inside = previous
            _running.depth -= 1

    def noticed_backward(self) -> None:
        """A backward reached the wrapper's parameters (a hook); outside the wrapper's own backward, a bypass."""
        if not self.inside and not getattr(_running, "depth", 0):
            self.bypassed = True

    def clear(self) -> None:
        """The gradients are reduced now (whatever produced them)."""
        self.bypassed = False

    def check(self) -> None:
        """Raise `BypassedBackwardError` (once per bypass) if a backward bypassed the wrapper."""
        if self.bypassed:
            self.bypassed = False
            raise BypassedBackwardError(
                f"{self.wrapper}: a backward pass reached the wrapped module's parameters without "
                f"{self.name}.backward (the inner model's own backward was called), so {self.consequence}. "
                f"Call {self.name}.backward(grad) instead of model.backward(grad)"
                + (" (inside ddp.no_sync() to accumulate locally)" if self.name == "ddp" else "")
            )

    def guard_steps(self, params: Iterable[Parameter]) -> list[RemovableHandle]:
        """Have optimizers run `check` before they update any of `params`."""
        return [p.register_pre_step_hook(lambda _: self.check()) for p in params]
