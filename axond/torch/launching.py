"""How `AxondProcessGroup` runs a torch collective: on the calling thread, completed at once (small ops, ops torch
waits for at once, hosts without a core to spare), or as axond async ops that a torch Work follows, so that torch
may overlap them with computation (DDP's buckets). `Launching` is the process group's mixin; `overlaps` decides
whether a host has the core a communication thread needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.profiler import record_function

from axond.config import OVERLAP_ENV, parse_overlap
from axond.distributed.backends.base import BackendOptions
from axond.distributed.policy import TORCH_SYNC_BYTES
from axond.errors import DistributedError
from axond.torch.completion import AxondWork, Completer, DoneWork
from axond.torch.identity import profiler_event, profiling

if TYPE_CHECKING:
    from axond.distributed.process_group import ProcessGroup

_PLAIN_DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool))
"""Dtypes whose CPU tensors are NumPy arrays as they are (`t.numpy()`: no bfloat16 widening, no conjugation)."""


def overlap_setting(environ: Mapping[str, str]) -> bool | None:
    """AXOND_TORCH_OVERLAP of `environ`: True (`1`), False (`0`) or None (`auto`, the default: decided per group by
    `overlaps`); `RuntimeEnv.torch_overlap` is this process's."""
    return parse_overlap(environ.get(OVERLAP_ENV))


def overlaps(host_ranks: int, host_cores: int, threads: int) -> bool:
    """Whether a communication thread can overlap collectives with computation: only if every rank on the host
    has a core for it beside its `threads` compute threads. Without one, the thread takes the core from the
    backward pass it was to overlap, and running the op on the calling thread is faster (docs/design/tuning.md)."""
    return host_cores >= host_ranks * (max(threads, 1) + 1)


class Launching:
    """The launch of `AxondProcessGroup`'s collectives (module docstring); the group provides the attributes below."""

    _options: BackendOptions
    _completer: Completer | None
    _overlap: bool | None
    _seq: int

    SYNC_BYTES = TORCH_SYNC_BYTES
    """Collectives moving at most this many bytes run on the calling thread (see `_launch`; the policy's
    `TORCH_SYNC_BYTES`); larger ones too where the host has no core to spare for a communication thread (`overlaps`)."""
    SYNC_WHEN_WAITED = True
    """Collectives torch waits for at once (its options' `asyncOp` False) run on the calling thread whatever their
    size (see `_launch`)."""

    @property
    def axond_group(self) -> ProcessGroup:
        raise NotImplementedError

    def _launch(self, op: str, calls: Sequence[Callable[..., Any]], finish: Callable[[list[Any]], Any],
                nbytes: int, opts: Any) -> AxondWork | DoneWork:
        """Run axond `calls` (each takes `async_op=`) and `finish`; the torch Work of the op.

        Ops the caller waits for at once (torch's options say `asyncOp` False: `dist.all_reduce(t)` without
        `async_op=True`, FSDP2's default unshard) and ops up to SYNC_BYTES run at once on the calling thread (a
        completed Work: no thread hops, which cost ~50-200 us on a busy host), as do all of them where the host has
        no core to spare (`overlap`); the others run as axond async ops, so torch may overlap them with compute
        (DDP's buckets). Either way a failure is raised by the Work's wait().
        """
        self._seq += 1
        if profiling():
            with record_function(profiler_event(op)):
                return self._launch_now(op, calls, finish, nbytes, opts)
        return self._launch_now(op, calls, finish, nbytes, opts)

    def _launch_now(self, op: str, calls: Sequence[Callable[..., Any]], finish: Callable[[list[Any]], Any],
                    nbytes: int, opts: Any) -> AxondWork | DoneWork:
        group = self.axond_group
        if nbytes > self.SYNC_BYTES and self._overlap and not self._waited_at_once(opts):
            assert self._completer is not None  # made with the axond group
            return self._completer.follow(op, [call(async_op=True) for call in calls], finish)
        try:
            value = finish([call(async_op=False) for call in calls])
        except Exception as e:
            return DoneWork(op, group.name, error=e, timeout=self._options.timeout)
        return DoneWork(op, group.name, value)

    def _at_once(self, t: torch.Tensor, opts: Any) -> bool:
        """Whether in-place op on `t` alone may skip staging and the launch: a plain dense CPU tensor that is its own
        NumPy view (`t.numpy()`), run on the calling thread anyway (see `_launch`), outside the profiler."""
        return (type(t) is torch.Tensor and t.dtype in _PLAIN_DTYPES and t.is_cpu and t.layout is torch.strided
                and not t.requires_grad and t.is_contiguous() and not profiling()
                and (t.nbytes <= self.SYNC_BYTES or not self._overlap or self._waited_at_once(opts)))

    def _run_at_once(self, op: str, call: Callable[..., Any], tensors: list[torch.Tensor], arg: Any) -> DoneWork:
        """The common small op, kept short (latency is most of its cost): `call(view of tensors[0], arg)` of the axond
        group (whose fast path takes it the short way where it can), here; a completed Work."""
        self._seq += 1
        group = self.axond_group
        try:
            call(tensors[0].numpy(), arg)
        except Exception as e:
            return DoneWork(op, group.name, error=e, timeout=self._options.timeout)
        return DoneWork(op, group.name, tensors)

    def _waited_at_once(self, opts: Any) -> bool:
        """Whether torch waits for the op as soon as it is launched (`dist.all_reduce(t)` without `async_op=True`)."""
        return self.SYNC_WHEN_WAITED and getattr(opts, "asyncOp", True) is False

    def _launch_started(self, op: str, start: Callable[[], Sequence[Any]], finish: Callable[[list[Any]], Any]
                        ) -> AxondWork | DoneWork:
        """The torch Work of the axond async works `start()` returns, completed (after `finish`) by the completion
        thread; a failure to start them is the Work's failure."""
        self._seq += 1
        group = self.axond_group
        assert self._completer is not None  # made with the axond group
        try:
            if profiling():
                with record_function(profiler_event(op)):
                    works = start()
            else:
                works = start()
        except DistributedError as e:
            return DoneWork(op, group.name, error=e, timeout=self._options.timeout)
        return self._completer.launch(op, works, finish)
