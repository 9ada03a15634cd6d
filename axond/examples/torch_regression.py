"""What the Lightning and Accelerate examples share: their data and a digest of the trained parameters."""

from __future__ import annotations

import hashlib

import torch
from torch.utils.data import TensorDataset


def dataset(samples: int) -> TensorDataset:
    """The same samples on every rank (a sampler or the framework gives each rank its share): y = sum(sin(x))."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 8, generator=gen)
    return TensorDataset(x, torch.sin(x).sum(dim=1, keepdim=True))


def digest(module: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes: equal digests mean bit-identical models."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
