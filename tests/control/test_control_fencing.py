"""The coordinator's side of fencing (axond/fencing.py): the next generation after a node was declared dead
waits the fence, whatever the settle time and however many nodes wait; a margin the workers cannot keep is
refused. The state machine runs with explicit time."""

from __future__ import annotations

import pytest

from axond.control.channel import CHANNEL_OPTIONS
from axond.coordinator.server import CoordinatorConfig
from axond.coordinator.state.jobs import JobState
from axond.coordinator.state.machine import CoordinatorState
from axond.errors import CoordinatorError
from axond.fencing import FENCE_OVERRUN_S, RECONNECT_BACKOFF_MAX_S, contact_window, fence_overrun, fence_wait


@pytest.mark.parametrize("lease", [1.0, 5.0])
def test_the_next_generation_after_a_death_waits_the_fence_even_with_every_node_there(lease: float) -> None:
    margin = 0.6
    state = CoordinatorState(heartbeat_interval=lease / 5, dead_after_missed=5, settle_time=0.0, fence_margin=margin)
    a, b, spare = (state.register_node(h, 0, False, 0.0).node_id for h in ("a", "b", "c"))
    for n in (a, b):
        state.join("j", n, 1, 2, 2, 3, now=0.0)
    j = state.jobs["j"]
    assert j.state is JobState.RUNNING and j.generation == 1
    t = 0.0
    while j.generation == 1:  # b falls silent; a and the spare keep heartbeating
        t += lease / 50
        for n in (a, spare):
            state.heartbeat(n, "j" if n == a else "", 1 if n == a else 0, now=t)
        state.tick(t)
    dead_at = t
    assert t - lease < lease / 5  # declared dead at the end of its lease (one scan late at most)
    wait = fence_wait(lease, lease / 5, margin)
    # Both live nodes join at once: MAX is reached, yet the round stays open until the fence has passed.
    assert state.join("j", a, 1, 2, 2, 3, now=dead_at) is None
    assert state.join("j", spare, 1, 2, 2, 3, now=dead_at) is None
    state.tick(dead_at + wait - 0.01)
    assert j.state is JobState.RESTARTING and not j.round.frozen
    for n in (a, spare):
        state.heartbeat(n, "j" if n == a else "", 2 if n == a else 0, now=dead_at + wait - 0.01)
    state.tick(dead_at + wait)
    assert j.round.frozen and j.generation == 2 and j.state is JobState.RUNNING


def test_a_node_that_left_does_not_hold_the_next_generation() -> None:
    state = CoordinatorState(heartbeat_interval=0.2, dead_after_missed=5, settle_time=0.0)
    a, b, c = (state.register_node(h, 0, False, 0.0).node_id for h in ("a", "b", "c"))
    for n in (a, b):
        state.join("j", n, 1, 2, 2, 3, now=0.0)
    state.deregister_node(b, now=0.1)  # it stopped its ranks before leaving: nothing to fence
    assert state.join("j", a, 1, 2, 2, 3, now=0.1) is None
    assert state.join("j", c, 1, 2, 2, 3, now=0.1) is not None  # frozen at once


def test_a_fence_margin_below_the_workers_overrun_is_refused() -> None:
    with pytest.raises(ValueError, match="fence_margin 0.1 s is below 0.25 s"):
        CoordinatorState(fence_margin=0.1)
    with pytest.raises(CoordinatorError, match="--fence-margin >= 0.25"):
        CoordinatorConfig(fence_margin=0.0, in_memory=True).validate()
    CoordinatorConfig(fence_margin=FENCE_OVERRUN_S, in_memory=True).validate()


def test_the_timing_holds_together() -> None:
    """The clients' reconnect backoff is what the window assumes; short leases make the coordinator wait longer;
    a node riding out an outage gets a window after its peers' contact is back at the test leases and the default."""
    assert dict(CHANNEL_OPTIONS)["grpc.max_reconnect_backoff_ms"] / 1000 <= RECONNECT_BACKOFF_MAX_S
    assert fence_overrun(5.0, 1.0) == FENCE_OVERRUN_S and fence_overrun(1.0, 0.2) > FENCE_OVERRUN_S
    assert fence_wait(1.0, 0.2, 1.0) > fence_wait(5.0, 1.0, 1.0) == 1.0
    assert contact_window(1.0, 0.2) > 1.5 and contact_window(5.0, 1.0) > 1.5
