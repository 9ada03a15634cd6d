"""The small MLP of bench/recovery.py in torch, for the torchft comparison (bench/torchft_compare.py).

The same data set (240 samples of 6 features, 3 classes), layers (Linear 6 -> 16, Tanh, Dropout 0.1, Linear 16 -> 3),
initial weights, optimizer (AdamW, lr 0.01) and gradient clipping (norm 1.0) as tests/helpers/live_train.py, which
axond's `DistributedTrainer` trains in bench/recovery.py; and the loss of a trained state on the whole data set (the
figure the comparison puts beside a fault-free run's). torch is imported by the functions that need it only.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

LIVE_TRAIN = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "live_train.py"
BATCH = 4
"""Samples per data-parallel rank (virtual rank or torchft replica group) per step, as in live_train.py."""
REPLICAS = 3
"""Data-parallel ranks on one host (bench/recovery.py: three virtual ranks); four across namespace hosts."""
SAMPLES = 240
EPOCHS = 3


def steps(replicas: int) -> int:
    """What live_train.py's `fit(3)` runs on `replicas` virtual ranks: 60 on three, 45 on four."""
    return SAMPLES // (BATCH * replicas) * EPOCHS


def live_train() -> ModuleType:
    """tests/helpers/live_train.py as a module (its data set and model are the reference)."""
    if "live_train" not in sys.modules:
        spec = importlib.util.spec_from_file_location("live_train", LIVE_TRAIN)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["live_train"] = module
        spec.loader.exec_module(module)
    return sys.modules["live_train"]


def data() -> tuple[np.ndarray, np.ndarray]:
    lt = live_train()
    return lt.X, lt.Y


def initial_state() -> dict[str, np.ndarray]:
    """live_train.py's initial parameters, drawn the same way (its layers in order from default_rng(3))."""
    from axond import nn

    rng = np.random.default_rng(3)
    model = nn.Sequential(nn.Linear(6, 16, rng=rng), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 3, rng=rng))
    return {k: np.array(v) for k, v in model.state_dict().items()}


def torch_mlp() -> Any:
    """The torch model with live_train.py's layers and initial weights (state-dict keys line up: 0.* and 3.*)."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial_state().items()})
    return model


def batch_indices(replica: int, step: int, replicas: int) -> np.ndarray:
    """The samples replica group `replica` of `replicas` trains on at global step `step`: its shard of the epoch's
    permutation (seeded by the epoch), BATCH of them at the step's place in the epoch."""
    epoch, place = divmod(step, SAMPLES // (BATCH * replicas))
    order = np.random.default_rng(1000 + epoch).permutation(SAMPLES)
    shard = order[replica::replicas]
    return shard[place * BATCH:(place + 1) * BATCH]


def full_loss(state: dict[str, Any]) -> float:
    """Cross-entropy of `state` (live_train.py's parameter names, numpy or torch arrays) on the whole data set,
    dropout off."""
    import torch

    model = torch_mlp()
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state.items()})
    model.eval()
    x, y = data()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)))
