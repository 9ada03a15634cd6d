"""A peer's failure never crashes the survivor of torch DDP / FSDP2 over "axond": it raises axond's error naming
the root cause, which is also torch's `DistBackendError` (a `RuntimeError`), and exits normally.

Before, a failed bucket all-reduce completed its future with the exception as its value and DDP's reducer read it
as tensors: SIGSEGV in `parseCppCommHookResult` (see `axond.torch.completion`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed (pip install -e '.[torch]')")

import torch_backend_faults as faults  # noqa: E402
from axond.testing import collect_from_processes  # noqa: E402

pytestmark = pytest.mark.slow  # torch DDP/FSDP2 ranks failing in real processes

TORCH_ERROR = ["TorchDistributedError", "DistributedError", "DistBackendError", "RuntimeError"]


def test_a_failing_or_killed_peer_is_raised_by_every_survivor() -> None:
    """Also: a barrier's timeout is torch's DistBackendError (TorchTimeoutError), worded as gloo's first."""
    items, codes = collect_from_processes(faults.survives, 2, expect=len(faults.SCENARIOS) + 3, timeout=120.0)
    seen = {scenario: (mro, message) for scenario, mro, message in items}
    assert list(seen) == [*faults.SCENARIOS, "timeout", "killed", "alone"], items
    mro, message = seen.pop("alone")  # a failed rendezvous inside torch's init_process_group: torch's classes too
    assert all(name in mro for name in TORCH_ERROR) and "peer ranks [1]" in message, (mro, message)
    mro, message = seen.pop("timeout")  # torch's wording first (torch's tests match " Timed out "), then axond's
    assert "TorchTimeoutError" in mro and all(name in mro for name in TORCH_ERROR), mro
    assert message.startswith("[axond] Timed out waiting 1000ms for barrier operation to complete: barrier on group"), \
        message
    for scenario, (mro, message) in seen.items():
        assert all(name in mro for name in TORCH_ERROR), (scenario, mro, message)
        if scenario != "killed":
            assert f"rank 1 failed: ValueError: bad batch on rank 1 ({scenario})" in message, (scenario, message)
    assert "peer rank 1" in seen["killed"][1], seen["killed"]
    assert codes == [0, -9], codes  # the survivor exits normally (a SIGSEGV was -11); rank 1 was killed
