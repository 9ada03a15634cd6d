"""What a checkpoint records besides the model and optimizer, so that a resumed run continues bit for bit.

Shared position (same on every rank): epoch, optimizer steps done in it, global step, history.
Per rank (keyed by rank, used only when resuming at the same world size): the random generators of
the model's modules (Dropout) and of NumPy's global generator, and the epoch's running loss sums.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from axond.nn.module import Module


@dataclass
class Position:
    """Where training stands: `step` optimizer steps of epoch `epoch` (0-based) are done."""

    epoch: int = 0
    step: int = 0
    global_step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)

    def to_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "global_step": self.global_step,
                "history": json.dumps(self.history)}

    @classmethod
    def from_objects(cls, objects: dict[str, Any]) -> Position:
        return cls(int(objects["trainer/epoch"]), int(objects["trainer/step"]), int(objects["trainer/global_step"]),
                   list(json.loads(objects["trainer/history"])))


def _generators(model: Module) -> dict[str, np.random.Generator]:
    return {name or "root": m.__dict__[attr] for name, m in model.named_modules()
            for attr in ("_gen", "rng", "generator") if isinstance(m.__dict__.get(attr), np.random.Generator)}


def capture_rank_state(model: Module, totals: np.ndarray) -> str:
    """This rank's random states and running sums, as one JSON string."""
    legacy = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    return json.dumps({
        "modules": {name: g.bit_generator.state for name, g in _generators(model).items()},
        "numpy": [legacy[0], legacy[1].tolist(), *legacy[2:]],
        "totals": totals.tolist(),
    })


def restore_rank_state(model: Module, text: str, totals: np.ndarray) -> None:
    """Put back what `capture_rank_state` recorded (generators are matched by module name)."""
    state = json.loads(text)
    gens = _generators(model)
    for name, st in state["modules"].items():
        if name in gens:
            gens[name].bit_generator.state = st
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    totals[:] = state["totals"]
