"""A rank that dies or stalls partway through a random program: the others raise, none hangs.

The programs are those of test_random_programs (four ranks on threads, four overlapping groups, blocking
and async steps). At a seeded step the victim either closes every group it is in (as a crashed
process's sockets close) or stops calling (as a rank stuck in its own code). Every other rank must then
either finish the program with correct results, when no later step needs the victim, or raise
`DistributedError` within the group timeout plus a margin. A rank that is a member of a later step with
the victim must raise. No rank may hang.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from axond import DistributedError, ProcessGroup
from axond.testing import run_on
from test_random_programs import GROUPS, Step, expected, program, run_steps, subgroups

TIMEOUT = 2.0
STALL = 1.5 * TIMEOUT
"""How long a stalling victim stops calling: past the group's timeout, so its peers give up waiting for it."""


def run_until(groups: list[ProcessGroup], steps: list[Step], victim: int, at: int, stall: bool) -> list[Any]:
    """Each rank's results, DistributedError or "victim", then the seconds it all took."""
    def body(world: ProcessGroup) -> Any:
        def dies_here(step: Step) -> bool:
            if world.rank != victim or step.index != at:
                return False
            if stall:
                time.sleep(STALL)
            for g in reversed(subs[world.rank]):
                g.destroy()
            return True

        try:
            results = run_steps(world.rank, subs[world.rank], steps, dies_here)
        except DistributedError as e:
            return e
        return "victim" if results is None else results

    started = time.monotonic()
    with subgroups(groups) as subs:
        out = run_on(groups, body, timeout=60.0)
    return [*out, time.monotonic() - started]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed, stall, transport", [
    (21, False, "auto"), (22, False, "sockets"), (23, False, "shm"), (24, False, "auto"),
    pytest.param(25, True, "auto", marks=pytest.mark.slow), pytest.param(26, True, "shm", marks=pytest.mark.slow),
    (27, False, "nodes"), pytest.param(28, True, "nodes", marks=pytest.mark.slow)])
@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
def test_survivors_raise_or_finish_correctly_and_none_hangs(make_groups: Any, seed: int, stall: bool,
                                                            transport: str) -> None:
    rng = np.random.default_rng(seed)
    steps = program(seed, 30)
    victim, at = int(rng.integers(4)), int(rng.integers(5, 25))
    out = run_until(make_groups(4, TIMEOUT, transport=transport), steps, victim, at, stall)
    elapsed = out.pop()
    assert out[victim] == "victim"
    assert elapsed < (STALL if stall else 0) + 4 * TIMEOUT + 10, elapsed
    raised = 0
    for rank, got in enumerate(out):
        if rank == victim:
            continue
        needs_victim = any(victim in GROUPS[s.group] and rank in GROUPS[s.group] and s.index >= at for s in steps)
        if isinstance(got, DistributedError):
            raised += 1
            assert got.op and got.group, got
            continue
        assert not needs_victim, f"rank {rank} finished a program whose later steps need the dead rank {victim}"
        for step in steps:
            ranks = sorted(GROUPS[step.group])
            if rank in ranks:
                want = expected(step, ranks.index(rank))
                if want is not None:
                    np.testing.assert_array_equal(got[step.index], want)
    assert raised >= 1
