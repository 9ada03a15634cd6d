"""`axond.reform()` when the job moves on again while the rank forms its group (found by bench/soak.py: a node left,
and before the survivors had formed the next generation's group, the failed node's worker joined back, opening the
one after; the survivors' group formation met "generation N is over" from the coordinator's store, the rank exited
with that `StoreError`, and its failure moved the job on again, a cascade of restarts). The rank now forms the group
of the later generation the worker names.

A real coordinator in this process, its job driven by a client as workers drive it; this process is rank 0 and forms
real (one-rank) tcp groups over the coordinator's store.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import axond
from axond.control.client import connect
from axond.coordinator.server import RunningCoordinator
from axond.distributed import membership
from axond.v1 import coordinator_pb2 as pb
from axond.worker.live import announce, assign

WAIT_S = 10.0


@pytest.fixture
def restore_environ() -> Iterator[None]:
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        membership.configure(None, 0, 0.0)


def joined_all(join: Callable[[str], pb.JoinResponse], nodes: list[str]) -> dict[str, pb.JoinResponse]:
    """Every node's Join of the same generation, at once (the round freezes once all of them joined)."""
    got: dict[str, pb.JoinResponse] = {}
    threads = [threading.Thread(target=lambda n=n: got.__setitem__(n, join(n))) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(got) == set(nodes)
    return got


def test_reform_takes_the_later_generation_when_the_one_it_forms_is_already_over(
        coordinator_factory: Callable[..., RunningCoordinator], tmp_path: Path, restore_environ: None) -> None:
    coordinator = coordinator_factory(dead_after_missed=120, settle_time=30.0)  # no heartbeats here: nobody dies
    client = connect(coordinator.address, call_timeout=10.0)
    try:
        a, b, c = (client.register_node(f"h{i}").node_id for i in range(3))

        def join(node: str) -> pb.JoinResponse:
            return client.join("j", node, 1, 1, 3, 0, timeout=30.0, live_recovery=True)

        first = joined_all(join, [a, b, c])[a]
        note = tmp_path / "membership-local0.json"
        os.environ.update({"AXOND_COORDINATOR": coordinator.address, "AXOND_JOB": "j", "AXOND_GENERATION": "1",
                           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "AXOND_JOB_SECRET": first.job_secret.hex(), "AXOND_LIVE_RECOVERY": "1",
                           "AXOND_MEMBERSHIP_FILE": str(note), "AXOND_LIVE_WAIT_S": str(WAIT_S)})
        axond.init_process_group("tcp", timeout=10.0)  # rank 0 of generation 1 (its own group of one)
        try:
            client.report_failure("j", b, 1, 1, 137, "killed")  # generation 2: a and c, live
            second = joined_all(join, [a, c])[a]
            assert second.generation == 2
            announce([str(note)], 2, "rank 1 left")
            assign([str(note)], second, "rank 1 left")  # the worker's word: rank 0 of generation 2 ...
            client.report_failure("j", c, 2, 1, 137, "killed")  # ... which is over before rank 0 formed its group
            third = join(a)
            assert third.generation == 3 and third.world_size == 1

            def worker_says_three() -> None:
                time.sleep(0.3)
                announce([str(note)], 3, "rank 1 left")
                assign([str(note)], third, "rank 1 left")
            threading.Thread(target=worker_says_three, daemon=True).start()
            group = axond.reform()  # generation 2's store refuses it: it waits for the word of 3 and forms there
            assert group.size == 1 and os.environ["AXOND_GENERATION"] == "3"
            live = membership.current()
            assert live is not None and live.generation == 3
            group.barrier()
        finally:
            axond.destroy_process_group()
    finally:
        client.close()
