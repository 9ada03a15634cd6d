"""The trainer's straggler callback: every rank is told, at the same step, which rank the others wait for."""

from __future__ import annotations

import time
from typing import Any

import pytest

from axond.config import RuntimeEnv
from axond.distributed import ProcessGroup
from axond.distributed.backends.base import BackendOptions
from axond.distributed.diagnostics.arrivals import Straggler
from axond.testing import run_threads
from axond.train import Callback, DistributedTrainer, StragglerCallback
from trainer_cases import make_trainer

WORLD = 4
SLOW_RANK, NAP_S = 2, 0.1
EVERY = 5
OPTIONS = BackendOptions(timeout=60.0, env=RuntimeEnv.from_env({"AXOND_STRAGGLER_WINDOW_OPS": "1"}))
"""A mark after every collective: this model's DDP step runs one all_reduce."""


class Nap(Callback):
    """`rank` computes NAP_S longer per step: the others wait for it in the next step's all_reduce."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        if trainer.rank == self.rank:
            time.sleep(NAP_S)


def _fit(g: ProcessGroup, slow: int) -> tuple[list[tuple[int, int, float]], list[tuple[int, int]]]:
    named: list[tuple[int, int, float]] = []
    recovered: list[tuple[int, int]] = []

    def on_straggler(trainer: DistributedTrainer, s: Straggler) -> None:
        named.append((trainer.position.global_step, s.rank, s.lost_s))

    def on_recovered(trainer: DistributedTrainer, rank: int) -> None:
        recovered.append((trainer.position.global_step, rank))

    watch = StragglerCallback(on_straggler, every=EVERY, on_recovered=on_recovered)
    callbacks: list[Any] = [Nap(slow), watch] if slow >= 0 else [watch]
    make_trainer(g, None, batch_size=2, checkpoint_every=None, callbacks=callbacks).fit(2)  # 2 x 9 steps
    return named, recovered


@pytest.mark.timeout(120)
def test_every_rank_is_told_the_straggler_at_the_same_step() -> None:
    results = run_threads(lambda g: _fit(g, SLOW_RANK), WORLD, options=OPTIONS)
    firsts = [named[0][:2] if named else None for named, _ in results]
    assert len(set(firsts)) == 1, f"every rank is told at the same step: {firsts}"
    assert firsts[0] is not None and firsts[0][1] == SLOW_RANK, results
    assert firsts[0][0] <= 10, "three windows of 300 ms hold 9 steps of 100 ms: named at the second check"
    assert all(lost >= NAP_S for named, _ in results for _, _, lost in named)


@pytest.mark.timeout(120)
def test_no_rank_is_named_when_none_is_slow() -> None:
    assert run_threads(lambda g: _fit(g, -1), WORLD, options=OPTIONS) == [([], [])] * WORLD


def test_every_must_be_a_step_count() -> None:
    with pytest.raises(ValueError, match="every must be >= 1"):
        StragglerCallback(lambda trainer, s: None, every=0)
