"""No two generations of a job at once, whatever the partition answers (tests/helpers/fencing_run.py).

A worker host cut off from the coordinator by iptables in its own namespace (DROP; REJECT with an ICMP port
unreachable and with a TCP reset, which a worker must not read as "the coordinator is restarting"; loss one way
only, each way; and a cut during a coordinator outage, before the coordinator is restarted): the coordinator starts
the job's next generation on the other host, and the cut-off host's ranks (which ignore SIGTERM) must be dead
before it starts. Needs root, `ip netns` and iptables (skipped otherwise, with the reason).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from axond.fencing import FENCE_MARGIN_S, FENCE_OVERRUN_S
from fencing_run import SHAPES, run_shape, unavailable
from netns import netns  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow  # real coordinator and workers in network namespaces, a partition each


@pytest.mark.timeout(150)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_cut_off_generation_is_dead_before_the_next_starts(netns, tmp_path: Path, shape: str) -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    outcome = run_shape(netns(3), shape, tmp_path, timeout=120)
    # The coordinator waits --fence-margin past the time the cut-off worker may take to kill its ranks; what the
    # run measures must be at least the margin less that overrun (10 ms of logging resolution aside).
    assert outcome.margin > FENCE_MARGIN_S - FENCE_OVERRUN_S - 0.02, (outcome.margin, outcome.log)
    assert outcome.cut_code == 3, outcome.log
    assert "lost the coordinator's lease" in outcome.log, outcome.log
