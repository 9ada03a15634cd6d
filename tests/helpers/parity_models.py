"""The small models and seeded batches that the data-parallel parity tests (DDP, FSDP) share."""

from __future__ import annotations

import numpy as np

import axond.nn as nn


def mlp(seed: int) -> nn.Sequential:
    rng = np.random.default_rng(seed)
    f = np.float64
    return nn.Sequential(
        nn.Linear(6, 16, dtype=f, rng=rng), nn.Tanh(), nn.Linear(16, 16, dtype=f, rng=rng), nn.GELU(),
        nn.LayerNorm(16, dtype=f), nn.Linear(16, 3, dtype=f, rng=rng),
    )


class TinyLM(nn.Module):
    """Embedding -> transformer block -> linear head: the parity test's "real model"."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.emb = nn.Embedding(11, 8, dtype=np.float64, rng=rng)
        self.block = nn.TransformerBlock(8, 2, mlp_ratio=2, dtype=np.float64, rng=rng)
        self.head = nn.Linear(8, 11, dtype=np.float64, rng=rng)

    def forward(self, x: np.ndarray) -> np.ndarray:
        return self.head(self.block(self.emb(x)))

    def backward(self, grad_out: np.ndarray) -> None:
        return self.emb.backward(self.block.backward(self.head.backward(grad_out)))


def mlp_data(step: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    return rng.standard_normal((rows, 6)), rng.integers(0, 3, rows)


def lm_data(step: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2000 + step)
    tokens = rng.integers(0, 11, (rows, 6))
    return tokens[:, :-1], tokens[:, 1:]
