"""Joining back in-process: a rank that starts fresh in a running job takes the whole training state from a live peer
(`axond.train.join`) and the run goes on bit for bit as if it had never been away; the step-boundary check of the
worker's note (`axond.distributed.boundary`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from axond.distributed import ProcessGroup, membership
from axond.distributed.boundary import moved_on
from axond.errors import DistributedError, MembershipChanged
from axond.testing import run_threads
from axond.train.join import check_fits, settle
from axond.train.live import roll_forward
from live_train import Hashes, build_trainer


@pytest.mark.parametrize("digest_every", [None, 7])
def test_a_fresh_rank_takes_the_state_of_a_running_one_and_the_run_goes_on_bit_identical(
        digest_every: int | None) -> None:
    reference = Hashes()
    run_threads(lambda g: build_trainer(g, [reference], virtual_ranks=3).fit(2), 1, 120.0)
    options: dict[str, Any] = {"virtual_ranks": 3, "digest_every": digest_every}

    def train(group: ProcessGroup) -> dict[str, Any]:
        hashes = Hashes()
        trainer = build_trainer(group, [hashes], **options)
        trainer.fit(1)
        fresh = group.rank == 2
        if fresh:  # this rank's process "restarted": a new trainer, no optimizer state, position 0
            hashes = Hashes()
            trainer = build_trainer(group, [hashes], **options)
        assert trainer.virtual is not None
        settled = settle(trainer.virtual, group, fresh, None if fresh else roll_forward)
        trainer.fit(2)
        return {"transfer": settled.transfer, "hashes": hashes.hashes, "step": trainer.position.global_step}

    results = run_threads(train, 3, 120.0)
    per_epoch = len(reference.hashes) // 2
    for rank, got in enumerate(results):
        moved = got["transfer"]
        assert moved is not None and moved.source == 0 and moved.joined == (2,) and moved.step == per_epoch
        assert moved.received == (rank == 2) and moved.nbytes > 0
        assert got["step"] == 2 * per_epoch
        assert got["hashes"][-per_epoch:] == reference.hashes[per_epoch:]  # every step after the join
    assert len(results[2]["hashes"]) == per_epoch  # the fresh rank ran only the steps after it joined


def test_a_fresh_zero1_rank_gets_its_shards_by_re_sharding_and_the_run_goes_on_bit_identical() -> None:
    """ZeRO-1: the joiner receives the position only; every shard's parameters and its block's optimizer state come by
    re-sharding (`axond.train.reassemble`): the running ranks' own shards, the lost block from rank 0's buddy copy."""
    reference = Hashes()
    run_threads(lambda g: build_trainer(g, [reference], virtual_ranks=3, parallel="zero").fit(2), 1, 120.0)

    def train(group: ProcessGroup) -> dict[str, Any]:
        hashes = Hashes()
        trainer = build_trainer(group, [hashes], virtual_ranks=3, parallel="zero")
        trainer.fit(1)
        fresh = group.rank == 2
        if fresh:  # this rank's process "restarted": a new trainer, no optimizer state, position 0
            hashes = Hashes()
            trainer = build_trainer(group, [hashes], virtual_ranks=3, parallel="zero")
        steps = trainer.virtual
        assert steps is not None
        settled = settle(steps, group, fresh, None if fresh else roll_forward)
        copied, _, daemon = steps._reshard(group, fresh=fresh)  # what VirtualSteps does after it (joiner or running)
        steps.started = True
        trainer.fit(2)
        return {"transfer": settled.transfer, "copied": copied, "daemon": daemon, "hashes": hashes.hashes}

    results = run_threads(train, 3, 120.0)
    per_epoch = len(reference.hashes) // 2
    for rank, got in enumerate(results):
        moved = got["transfer"]
        assert moved is not None and moved.joined == (2,) and moved.step == per_epoch and moved.nbytes == 0
        assert got["copied"] == [2] and got["daemon"] == []
        assert got["hashes"][-per_epoch:] == reference.hashes[per_epoch:]  # every step after the join
    assert len(results[2]["hashes"]) == per_epoch


def test_without_fresh_ranks_nothing_is_sent() -> None:
    def agree(group: ProcessGroup) -> object:
        trainer = build_trainer(group, [], virtual_ranks=2)
        assert trainer.virtual is not None
        return settle(trainer.virtual, group, False, roll_forward).transfer

    assert run_threads(agree, 2, 60.0) == [None, None]


def test_a_world_larger_than_the_virtual_ranks_says_what_to_pass() -> None:
    with pytest.raises(DistributedError, match="virtual_ranks"):
        check_fits(4, 3)


def test_a_newer_note_at_a_step_boundary_tells_the_group_and_raises(tmp_path: Path) -> None:
    path = str(tmp_path / "membership-local0.json")
    membership.configure(path, 2, 1.0)
    try:
        def boundary(group: ProcessGroup) -> object:
            first = moved_on(group)  # no note yet: a stat, nothing else
            group.barrier()
            if group.rank == 0:
                with open(path + ".tmp", "w", encoding="utf-8") as f:
                    json.dump({"generation": 3, "ready": False, "reason": "node n9 (h9) joined"}, f)
                os.replace(path + ".tmp", path)
            group.barrier()
            second = moved_on(group) if group.rank == 0 else None
            if group.rank == 1:  # told by rank 0's abort, not left waiting for it
                with pytest.raises(DistributedError):
                    group.barrier()
            return first, second

        (first, changed), (other, _) = run_threads(boundary, 2, 60.0)
        assert first is None and other is None
        assert isinstance(changed, MembershipChanged) and changed.generation == 3 and "joined" in changed.reason
    finally:
        membership.configure(None, 0, 0.0)
