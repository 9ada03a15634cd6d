"""No two generations of a job at once, whatever the partition answers (tests/helpers/fencing_run.py).

A worker host cut off from the coordinator by iptables in its own namespace (DROP; REJECT with an ICMP port
unreachable and with a TCP reset, which a worker must not read as "the coordinator is restarting"; loss one way
only, each way; and a cut during a coordinator outage, before the coordinator is restarted): the coordinator starts
the job's next generation on the other host, and the cut-off host's ranks (which ignore SIGTERM) must be dead
before it starts. Needs root, `ip netns` and iptables (skipped otherwise, with the reason).

The shapes selected run at once, each in a network of its own (a module fixture), and each test asserts its own
shape's outcome: the runs mostly wait on leases, so together they take not much longer than one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from axond.fencing import FENCE_MARGIN_S, FENCE_OVERRUN_S
from axond.testing.netns import Network
from axond.testing.netns import unavailable as netns_unavailable
from fencing_run import SHAPES, Outcome, run_shape, unavailable

pytestmark = pytest.mark.slow  # real coordinator and workers in network namespaces, a partition each


def _run(shape: str, workdir: Path, cut: threading.Barrier) -> Outcome | BaseException:
    def line_up() -> None:
        try:
            cut.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass  # another run failed before its cut: this one goes on alone

    try:
        with Network.create(3) as net:
            return run_shape(net, shape, workdir, timeout=120, before_cut=line_up)
    except Exception as e:  # noqa: BLE001 - reported by the shape's own test
        cut.abort()
        return e


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Shape -> its run's Outcome (or what it raised), for the shapes of the tests selected in this module. The runs
    cut their links at the same moment, once every job runs on both hosts, so that no run's start (a coordinator, two
    workers) competes for the cores with another's fence."""
    reason = netns_unavailable() or unavailable()
    if reason:
        pytest.skip(reason)
    shapes = sorted({item.callspec.params["shape"] for item in request.session.items
                     if item.module is request.module and hasattr(item, "callspec")}, key=list(SHAPES).index)
    root = tmp_path_factory.mktemp("fencing")
    cut = threading.Barrier(len(shapes))
    with ThreadPoolExecutor(len(shapes)) as pool:
        results = dict(zip(shapes, pool.map(lambda s: _run(s, root / s, cut), shapes)))
    yield results


@pytest.mark.timeout(200)  # the first test's setup runs every shape (at once)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_cut_off_generation_is_dead_before_the_next_starts(outcomes: dict[str, object], shape: str) -> None:
    outcome = outcomes[shape]
    if isinstance(outcome, BaseException):
        raise outcome
    assert isinstance(outcome, Outcome)
    # The coordinator waits --fence-margin past the time the cut-off worker may take to kill its ranks; what the
    # run measures must be at least the margin less that overrun (10 ms of logging resolution aside).
    assert outcome.margin > FENCE_MARGIN_S - FENCE_OVERRUN_S - 0.02, (outcome.margin, outcome.log)
    assert outcome.cut_code == 3, outcome.log
    assert "lost the coordinator's lease" in outcome.log, outcome.log
