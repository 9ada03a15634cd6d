"""The replica check on virtual ranks (`axond.train.agreed`): the agreed state kept in memory changes no bit of
training, and with no strict majority every rank raises (tests/worker/test_worker_live_diverge.py runs the live job
whose diverged node leaves)."""

from __future__ import annotations

import numpy as np

from axond.distributed import ProcessGroup
from axond.errors import ReplicaDivergence
from axond.testing import run_threads
from axond.train import Callback, DistributedTrainer
from live_train import Hashes, build_trainer


def _hashes(world: int, **options: object) -> list[list[str]]:
    def train(group: ProcessGroup) -> list[str]:
        hashes = Hashes()
        build_trainer(group, [hashes], virtual_ranks=2, **options).fit(1)
        return hashes.hashes

    return run_threads(train, world, timeout=120.0)


def test_checking_and_keeping_the_agreed_state_changes_no_bit() -> None:
    (plain,) = _hashes(1)
    checked = _hashes(2, digest_every=3)
    assert checked == [plain, plain]


class Flip(Callback):
    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        if trainer.rank == 1 and metrics["global_step"] == 2:
            next(iter(trainer.module.parameters())).data.reshape(-1).view(np.uint32)[0] ^= np.uint32(1 << 22)


def test_with_no_strict_majority_every_rank_raises_naming_both() -> None:
    def train(group: ProcessGroup) -> tuple[list[int], str]:
        try:
            build_trainer(group, [Flip()], virtual_ranks=2, digest_every=3).fit(1)
        except ReplicaDivergence as e:
            return e.ranks, str(e)
        return [], "no error"

    for ranks, text in run_threads(train, 2, timeout=120.0):
        assert ranks == [0, 1] and "replicas disagree after step 3" in text and "no majority" in text, text
